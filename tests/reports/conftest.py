import pytest
from synthetic_run import write_synthetic_run


@pytest.fixture
def synthetic_run(tmp_path):
    return write_synthetic_run(tmp_path / "run-a")
