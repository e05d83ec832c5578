"""train.report on synthetic logs: the table, the growth ratio, the figure, the zoo install guard."""
import json

import pytest

from tests.helpers import random_model, write_checkpoint
from train.report import chasing, install_zoo, main, plot, read_logs, table


def _log(name, rms, losses, gate=None, params=1000):
    evals = [{"step": 100 * i, "val_loss": l, "prelogit_rms": r, "max_abs_logit": 10 * r, "gate": gate, "train_loss": l}
             for i, (r, l) in enumerate(zip(rms, losses))]
    sched = {"calibration_step": 100, "gate_zero_from": 200, "warmup_steps": 100, "taper_steps": 100}
    return {"preset": name, "params": params, "evals": evals, "schedule": sched if gate is not None else None,
            "calibration": {"step": 100} if gate is not None else None}


@pytest.fixture
def runs(tmp_path):
    logs = {"baseline": _log("baseline", [1, 1, 1, 1], [3.0, 2.0, 1.5, 1.0]),
            "all-taper": _log("all-taper", [1, 1.2, 1.2, 1.32], [3.0, 2.0, 1.5, 1.02], gate=0.0),
            "all-taper-noanchor": _log("all-taper-noanchor", [0.05, 1.0, 2.0, 4.0], [3.0, 2.0, 1.6, 1.1], gate=0.0)}
    root = tmp_path / "runs"        # its own folder: the reports go beside it (an output inside an input is refused)
    for name, log in logs.items():
        (root / name).mkdir(parents=True)
        (root / name / "train_log.json").write_text(json.dumps(log))
    return root


def test_table_and_growth(runs, tmp_path):
    logs = read_logs(runs)
    t = table(logs)
    assert "| all-taper | 1,000 | 300 | 0 | 1.0200 | +2.00% | within 3% |" in t
    ch = chasing(logs)
    assert ch["whole run"]["growth_ratio"] == pytest.approx((4.0 / 0.05) / 1.32)
    assert ch["from calibration"]["all-taper"]["ratio"] == pytest.approx(1.1)
    assert ch["from calibration"]["growth_ratio"] == pytest.approx(4.0 / 1.1)
    (tmp_path / "fig").mkdir()
    plot(logs, tmp_path / "fig" / "rms.png")
    assert (tmp_path / "fig" / "rms.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_prints_table_and_growth(runs, capsys, tmp_path):
    assert main(["--runs", str(runs), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "all-taper-noanchor grows" in out and "| baseline |" in out
    assert json.loads((tmp_path / "r.json").read_text())["chasing"]["whole run"]["growth_ratio"] > 3


def test_zoo_refuses_an_unfinished_taper(tmp_path):
    write_checkpoint(tmp_path / "runs" / "internal-taper", random_model(norm="taper", taper_scope="internal", gate=0.3))
    from core.errors import UserError
    with pytest.raises(UserError, match="gate 0.3"):
        install_zoo(tmp_path / "runs", tmp_path / "zoo")
    assert not (tmp_path / "zoo" / "internal-taper").exists()
    write_checkpoint(tmp_path / "runs" / "dyt", random_model(norm="dyt"))
    (tmp_path / "runs" / "internal-taper" / "config.json").unlink()
    import shutil
    shutil.rmtree(tmp_path / "runs" / "internal-taper")
    assert install_zoo(tmp_path / "runs", tmp_path / "zoo") == ["dyt"]
    assert (tmp_path / "zoo" / "dyt" / "model.safetensors").is_file()
