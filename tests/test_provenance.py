"""config.json records the ρ a calibrated run measured at, beside (not inside) the hashed config."""

import json
import os

import pytest

from quotient_manifolds.experiments import calibrate
from quotient_manifolds.experiments.runner import OutputDir


def test_calibrated_rho_is_recorded_without_changing_the_config_hash(tmp_path):
    config = {"rho": {"adaptive": 1.5, "inv": 0.2, "mix": 0.2}, "n_iters": 2}
    cal = {"calibrated": ["adaptive", "mix"], "rho": {"adaptive": 2.175, "inv": 0.9, "mix": 0.25}}
    with OutputDir(str(tmp_path), "text", config) as od:
        first_hash = od.hash
        calibrate._record_rho(od, config, cal)
    with open(os.path.join(tmp_path, "config.json")) as fh:
        saved = json.load(fh)
    assert saved["rho_used"] == {"adaptive": 2.175, "inv": 0.2, "mix": 0.25}  # inv not calibrated
    assert saved["config"]["rho"] == config["rho"] and saved["config_hash"] == first_hash
    with OutputDir(str(tmp_path), "text", config) as od:  # the directory stays resumable
        assert od.hash == first_hash
    with pytest.raises(ValueError, match="own fields"):
        od.record_in_config("config_hash", "x")


@pytest.mark.parametrize("study", ["text-paper-seeds", "vision-finetune", "vision-finetune-gpu"])
def test_committed_config_records_the_rho_its_records_used(study):
    src = os.path.join(os.path.dirname(__file__), "..", "experiments", "results", study)
    with open(os.path.join(src, "config.json")) as fh:
        saved = json.load(fh)
    with open(os.path.join(src, "results.jsonl")) as fh:
        rec = json.loads(fh.readline())
    assert rec["config_hash"] == saved["config_hash"]
    assert saved["rho_used"] == rec["study_config"]["rho"]
