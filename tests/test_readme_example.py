"""The README's "Check your own backward" example runs as written: its net ties (exit 0) and its own
catalogue entry goes red (exit 1, first at the node it breaks), both through `gradtie.check`."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text[text.index("## Check your own backward"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_own_net_example_runs_as_written(capsys):
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(_example(), str(README), "exec"), namespace)
    report, planted = namespace["report"], namespace["planted"]
    assert report.exit_code == 0, report.summary()
    assert report.tie.tied and all(r.verdict != "FAILED" for r in report.fd_rows)
    assert planted.exit_code == 1 and planted.tie.first_failure().name == "fc.bias", planted.summary()
    assert "head_bias_doubled" in {b.name for b in namespace["NET"].bugs}
    out = capsys.readouterr().out
    assert "exit 0: tied" in out and "exit 1: a row failed" in out


def test_the_custom_entry_applies_by_the_kit_calls():
    namespace: dict = {"__name__": "readme_example"}
    code = _example().split("# check it")[0]        # the definitions alone
    exec(compile(code, str(README), "exec"), namespace)
    from gradtie.checks import bugs
    net = namespace["NET"]
    assert "head_bias_doubled" in bugs.catalogue(net) and namespace["BIAS_TWICE"].applies(net)
    assert bugs.plant("head_bias_doubled", net).net.name == "mynet"
