"""A saved plan (`meshtron plan --save`, then `meshtron train --plan FILE`) is checked against
the run before its size starts anything: a plan for another model is named as that.

Through `meshtron.cli.main` in this process: every refusal here comes before any rank starts.
"""

from __future__ import annotations

import pytest

from meshtron.cli import main
from testkit.plan_cli import refused


def test_a_plan_for_another_model_is_named_before_its_rank_count(capsys, tmp_path):
    """A user audit: a 64-GPU plan for Llama 3 70B given with --model llama3-8b was told only
    "--nproc=64: allowed 1..32 local ranks on this machine" (the plan's size was checked
    first), which sends the user after the wrong field."""
    plan = tmp_path / "p70.toml"
    assert main(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100:8", "--top", "1",
                 "--layout", "tp=8,pp=1,dp=8", "--save", str(plan)]) == 0
    run = tmp_path / "run"
    line = refused(capsys, "train", "--model", "llama3-8b", "--plan", plan, "--steps", "1",
                   "--run-dir", run)
    assert "plan.model='llama3-70b'" in line and "llama3-8b" in line, line
    assert not run.exists()
    # The plan's own model: the rank count is then the first thing wrong on this machine,
    # named as the plan's (the user typed no --nproc; it read "--nproc=64: allowed 1..32").
    line = refused(capsys, "train", "--plan", plan, "--steps", "1", "--run-dir", run)
    assert f"error: --plan {plan}: the plan is for 64 ranks (plan.gpus)" in line, line
    assert "--nproc" not in line, line
    assert not run.exists()
    line = refused(capsys, "train", "--plan", plan, "--nproc", "64", "--steps", "1",
                   "--run-dir", run)  # typed: named as typed
    assert "error: --nproc=64: allowed 1.." in line, line


SMALL_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300,
               "max_position_embeddings": 256}


def test_a_plan_saved_with_a_relative_model_path_is_read_from_another_folder(tmp_path,
                                                                               monkeypatch):
    """Audit s54: `plan --model cfg/small.json --save p.toml` recorded the path as typed, so
    `cost --plan ../p.toml` from another folder said "model='cfg/small.json': file does not
    exist" (train and rehearse too), and restating the file as `--model ./cfg/small.json`
    was refused as contradicting the plan: no spelling priced it. Now the plan records the
    file's absolute path and a flag naming the same file restates it."""
    import json

    from testkit.cli_inproc import meshtron_main

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "small.json").write_text(json.dumps(SMALL_LLAMA))
    (tmp_path / "cfg" / "copy.json").write_text(json.dumps(SMALL_LLAMA))
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    rc, _, err = meshtron_main("plan", "--model", "cfg/small.json", "--cluster", "nominal-cpu:2",
                               "--global-batch", "16", "--seq-len", "128", "--top", "1",
                               "--save", "p.toml")
    assert rc == 0, err
    price = ("--price-on-demand", "1", "--gpu-watts", "100", "--runs", "50")
    monkeypatch.chdir(tmp_path / "sub")
    rc, out, err = meshtron_main("cost", "--plan", "../p.toml", *price)
    assert rc == 0 and out.startswith("Plan: tp=1,pp=1,dp=2"), err
    rc, out, err = meshtron_main("simulate", "--step", "--plan", "../p.toml")
    assert rc == 0 and "simulated" in out, err
    monkeypatch.chdir(tmp_path)
    rc, out, err = meshtron_main("cost", "--plan", "p.toml", "--model", "./cfg/small.json",
                                 *price)
    assert rc == 0, err
    # another file (the same fields) is another model as far as the flag goes: still refused
    rc, out, err = meshtron_main("cost", "--plan", "p.toml", "--model", "cfg/copy.json", *price)
    assert rc == 2 and "model='cfg/copy.json': contradicts the plan p.toml" in err, err


CONFIG_JSON_TRAIN = ["train", "--zero", "1", "--eval-every", "0", "--seq-len", "32",
                     "--global-batch", "4", "--run-dir", "run"]


BOX = ("peak_tflops = 0.2\nmemory_gib = 4\ngpus_per_node = 1\nnodes = 1\n"
       "intra_node_gb_per_s = 5\ninter_node_gb_per_s = 5\nhost_memory_gib = 16\n")
"""cal/box.toml: a cluster file as `meshtron calibrate` writes one."""


@pytest.fixture(scope="module")
def config_json_run(tmp_path_factory):
    """The folder of `meshtron train --model cfg/config.json --cluster cal/box.toml
    CONFIG_JSON_TRAIN --steps 2 --checkpoint-every 2` (a planned 1-rank launch, in this
    process) beside its cfg/, cal/ and an empty sub/: priced as it is by two tests (its model,
    its cluster file), resumed from a copy by another (one launch, not one each; suite time).
    Read only."""
    import json

    from testkit.cli_inproc import meshtron_main

    root = tmp_path_factory.mktemp("config-json")
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_text(json.dumps(SMALL_LLAMA))
    (root / "cal").mkdir()
    (root / "cal" / "box.toml").write_text(BOX)
    (root / "sub").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        rc, _, err = meshtron_main(*CONFIG_JSON_TRAIN, "--model", "cfg/config.json", "--cluster",
                                   "cal/box.toml", "--steps", "2", "--checkpoint-every", "2")
    assert rc == 0, err
    return root


def test_a_run_folders_plan_of_a_config_json_model_is_priced(config_json_run, monkeypatch):
    """Audit s54: a run's plan.toml names a Hugging Face config's model by the model's name
    ('cfg' for cfg/config.json, 'small' for cfg/small.json), which `cost --plan RUN/plan.toml`
    read as a preset or a folder ("the folder holds no config.json"; simulate and rehearse
    too), and `--model cfg/config.json` contradicted it. The run.toml beside the plan holds
    that model: priced as the run's."""
    from testkit.cli_inproc import meshtron_main

    assert 'model = "cfg"' in (config_json_run / "run" / "plan.toml").read_text()
    monkeypatch.chdir(config_json_run / "sub")  # where 'cfg' is no folder: the run's own model
    _priced_as_predicted("../run/plan.toml", config_json_run / "run")
    rc, out, err = meshtron_main("simulate", "--step", "--plan", "../run/plan.toml")
    assert rc == 0 and "simulated" in out, err


def test_a_run_on_a_cluster_file_records_the_file_for_cost(config_json_run, monkeypatch):
    """Audit s54: a run trained with `--cluster cal/box.toml` (a calibration's file) recorded
    the cluster by its stem ('box') in plan.toml, and `cost --plan RUN/plan.toml` refused it
    ("expected a preset ... or a TOML file path"), `--cluster cal/box.toml` as a
    contradiction. The plan now records the file by its absolute path: priced from another
    folder as the run predicted. The run: the module's config.json run, trained on that file
    (its own 1-rank launch of the debug preset here cost ~6 CPU s; suite time)."""
    from testkit.cli_inproc import meshtron_main

    saved = (config_json_run / "run" / "plan.toml").read_text()
    assert f'cluster = "{config_json_run / "cal" / "box.toml"}"' in saved, saved
    monkeypatch.chdir(config_json_run / "sub")
    _priced_as_predicted("../run/plan.toml", config_json_run / "run")
    rc, out, err = meshtron_main("cost", "--plan", "../run/plan.toml", "--cluster",
                                 "../cal/box.toml", "--price-on-demand", "1", "--gpu-watts",
                                 "100", "--runs", "50")
    assert rc == 0, err


def test_a_model_bearing_a_presets_name_but_not_its_shapes_is_not_priced_as_the_preset(
        tmp_path, monkeypatch, resumed_launch):
    """Audit s54: a config.json in a folder named like a preset ('debug/config.json', as
    `--local-dir llama3-8b` makes) was named after the preset, so the run's plan.toml said
    model = "debug" and `cost --plan RUN/plan.toml` priced the preset, not the run's model (a
    step time the run never predicted); a preset with overrides in a run file the same. Such
    a model is 'debug-custom'; the same shapes keep the preset's name. The preset's run is
    conftest.py `resumed_launch` (the debug preset at --zero 1, --seq-len 32, --global-batch
    4, as the run here: the same plan and price; its own 1-rank launch here cost ~6 CPU s)."""
    import json

    from meshtron.config import model_from_value
    from meshtron.model.spec import PRESETS, resolve_model
    from testkit.cli_inproc import meshtron_main

    (tmp_path / "debug").mkdir()
    (tmp_path / "debug" / "config.json").write_text(json.dumps(SMALL_LLAMA))
    monkeypatch.chdir(tmp_path)
    assert resolve_model("debug/config.json").name == "debug-custom"
    assert model_from_value({"preset": "debug", "layers": 3}).name == "debug-custom"
    assert model_from_value({"preset": "debug"}).name == "debug"
    assert model_from_value(PRESETS["debug"].to_dict()).name == "debug"
    preset, _ = resumed_launch
    assert 'model = "debug"' in (preset / "plan.toml").read_text()
    rc, _, err = meshtron_main("train", "--model", "debug/", "--zero", "1", "--steps", "1",
                               "--eval-every", "0", "--seq-len", "32", "--global-batch", "4",
                               "--run-dir", "run")
    assert rc == 0, err
    assert 'model = "debug-custom"' in (tmp_path / "run" / "plan.toml").read_text()
    steps = {name: _priced_as_predicted(f"{run}/plan.toml", tmp_path / run)
             for name, run in (("preset", preset), ("run", "run"))}
    assert steps["run"] != pytest.approx(steps["preset"], rel=1e-2)  # two models, two prices


def _priced_as_predicted(plan: str, run) -> float:
    """`cost --plan PLAN`'s step time, asserted equal to what the run folder `run` predicted
    (summary.json) for its own steps."""
    import json

    from testkit.cli_inproc import meshtron_main

    rc, out, err = meshtron_main("cost", "--plan", plan, "--price-on-demand", "1",
                                 "--gpu-watts", "100", "--runs", "50", "--json")
    assert rc == 0, err
    step = json.loads(out)["step_time_s"]
    predicted = json.loads((run / "summary.json").read_text())["predicted_step_time_s"]
    assert step == pytest.approx(predicted, rel=1e-3), plan
    return step


def test_two_config_files_of_one_folder_are_two_names_and_an_old_run_resumes(tmp_path,
                                                                            monkeypatch,
                                                                            config_json_run):
    """Audit s54, finding 6: `--model cfg/a.json` and `--model cfg/b.json` were both named
    'cfg' (the folder) in every table, run.toml, plan.toml and done line; a config file not
    called config.json is named by its stem (model/hf_config.py `_folder_name`; a stem that
    is a preset's name without its shapes is '<preset>-custom'). A run recorded under the
    folder's name (cfg/config.json: 'cfg', as runs were before) resumes with the same shapes
    from cfg/a.json (resume compares shapes, not names) and is 'a' from then on; its plan.toml
    is priced from a folder that holds a folder 'a'."""
    import json
    import shutil

    from testkit.cli_inproc import meshtron_main

    (tmp_path / "cfg").mkdir()
    for name, layers in (("config", 2), ("a", 2), ("b", 3), ("debug", 3)):
        (tmp_path / "cfg" / f"{name}.json").write_text(
            json.dumps({**SMALL_LLAMA, "num_hidden_layers": layers}))
    monkeypatch.chdir(tmp_path)
    heads = {}
    for name in ("a", "b", "debug"):
        rc, out, err = meshtron_main("plan", "--model", f"cfg/{name}.json", "--cluster",
                                     "nominal-cpu:1", "--global-batch", "4", "--seq-len", "32",
                                     "--top", "1")
        assert rc == 0, err
        heads[name] = out.split(" (")[0]
    assert heads == {"a": "a", "b": "b", "debug": "debug-custom"}, heads
    # the module's run of cfg/config.json (the same shapes as cfg/a.json here), copied
    shutil.copytree(config_json_run / "run", tmp_path / "run")
    assert 'model = "cfg"' in (tmp_path / "run" / "plan.toml").read_text()
    rc, out, err = meshtron_main(*CONFIG_JSON_TRAIN, "--model", "cfg/a.json", "--steps", "3",
                                 "--resume")
    assert rc == 0, err
    assert "extending the run from train.steps=2 to 3" in err and "done: a (" in out, out + err
    assert 'model = "a"' in (tmp_path / "run" / "plan.toml").read_text()
    assert 'name = "a"' in (tmp_path / "run" / "run.toml").read_text()
    (tmp_path / "sub" / "a").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "sub")  # 'a' here is an empty folder: the run's model wins
    _priced_as_predicted("../run/plan.toml", tmp_path / "run")
