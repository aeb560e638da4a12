import pytest

from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.results.run_folder import save_run
from cdbench.workloads.request import Request


@pytest.fixture(scope="session")
def simulated_run(tmp_path_factory):
    """A small real simulation saved as a run folder (no workload generator or cost catalog involved)."""
    requests = [Request(i, i * 0.005, 64, 6) for i in range(20)]
    config = policy("sglang", overlap=False)
    result = simulate(requests, config, ModelExecutor(FixedGrammarCosts()), FixedGpuCosts(forward_base_s=0.01), seed=1)
    return save_run(result, config, tmp_path_factory.mktemp("runs") / "sim")
