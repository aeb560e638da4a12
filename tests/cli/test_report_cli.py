from typer.testing import CliRunner

from cdbench.cli.app import app

runner = CliRunner()


def test_report_rebuilds_markdown_and_plots(simulated_run):
    folder = simulated_run.folder
    result = runner.invoke(app, ["report", str(folder)])
    assert result.exit_code == 0, result.output
    assert "Latency (ms)" in result.output and f"report: {folder / 'report.md'}" in result.output
    text = (folder / "report.md").read_text()
    assert "| TTFT |" in text and "![ttft_cdf](plots/ttft_cdf.png)" in text
    assert (folder / "plots" / "step_breakdown.png").is_file()


def test_report_of_a_missing_folder_is_one_line(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert result.output.startswith("error:") and "not a cdbench run folder" in result.output


def test_every_command_has_help_with_an_example():
    for command in ("run", "compare", "sweep", "report", "gate"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0
        assert "Example" in result.output, command
