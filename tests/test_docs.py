"""The documentation site builds with warnings as errors (a broken link, an anchor that does not
exist or a page left out of the navigation fails), its reference pages are generated from the
code, the README's links point at files that exist, and every command the README and the docs
show parses, names real flags, and (the cheap ones) runs as typed (tests/doc_commands.py reads
them from the Markdown)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_commands import (DOCS, Command, fenced_commands, inline_meshtron_spans,  # noqa: E402
                          inline_spans, meshtron_argv)

ROOT = Path(__file__).resolve().parents[1]


def test_site_builds_strict_with_generated_reference(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "site"
    cli = (site / "reference/cli/index.html").read_text()
    from meshtron.cli import COMMANDS
    for name in COMMANDS:  # every subcommand's own usage line, from its parser
        assert f"usage: meshtron {name}" in cli, name
    config = (site / "reference/config/index.html").read_text()
    for key in ("data.seq_len", "optim.warmup_steps", "train.steps", "model.kv_heads",
                "grad_compression"):
        assert key in config, key
    assert "Sequences per optimizer step, summed over all data-parallel ranks." in config
    api = (site / "reference/api/index.html").read_text()
    for name in ("parallelize", "build_mesh", "search_plans", "Plan"):
        assert f"meshtron.{name}" in api, name


def test_readme_links_exist_and_readme_is_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160, "the README is an entry point; details go in docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    for link in local:
        assert (ROOT / link).exists(), link


def test_doc_links_resolve_in_the_repository():
    """Every relative link of the README and the docs' pages names a file of the repository, so
    that it works when the repository is browsed, not only in the built site (the generated
    reference pages have a placeholder in docs/reference/: their links were dead there, user
    audit 48b)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    dead = [f"{page.relative_to(ROOT)}: {link}" for page in pages
            for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
            if "://" not in link and not link.startswith("mailto:")
            and not (page.parent / link).exists()]
    assert not dead, dead


# ---- every command the docs show (tests/doc_commands.py reads them from the Markdown) ----------
# Flags the docs name that belong to other programs (the tool named beside them in the text).
FOREIGN_FLAGS = {
    "--no-deps": "pip", "--ntasks-per-node": "srun", "--strict": "mkdocs",
    "--durations": "pytest", "--collect-only": "pytest", "--assert": "pytest",
    "--no-loadscope-reorder": "pytest-xdist",
    **dict.fromkeys(("--nproc-per-node", "--rdzv-backend", "--shutdown-timeout"), "torchrun"),
    **dict.fromkeys(("--decoder-first", "--fp8-param-gather", "--recompute-method",
                     "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
                     "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                     "--use-distributed-optimizer", "--use-custom-fsdp", "--use-megatron-fsdp",
                     "--data-parallel-sharding-strategy",
                     "--pipeline-model-parallel-layout"), "Megatron-LM"),
}

# The commands the default suite runs (torch-free: a few seconds each, ~15 s in all), keyed by
# subcommand; every other documented command is parsed only, for the reason given.
CHEAP = {"plan", "cost", "simulate", "doctor"}
NOT_RUN = {
    "train": "starts torch ranks (tens of seconds each): parsed here, run by the slow "
             "test_documented_train_commands_run with --steps 2",
    "demo": "calibrates and trains for minutes", "calibrate": "starts 4 torch ranks (~15 s)",
    "rehearse": "imports torch; a 70B rank takes ~50-100 s", "export": "needs a trained run",
    "merge": "needs trained runs", "doctor": "reads a run folder a hung run left",
    "tokenize": "reads a corpus and a tokenizer.json the docs only name",
}


def _subcommands():
    from meshtron.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


def test_docs_show_commands():
    """The extraction finds the commands (a change of the fence syntax must not empty it)."""
    cmds = fenced_commands()
    argvs = [meshtron_argv(c) for c in cmds]
    assert len([a for a in argvs if a]) >= 50, len(cmds)
    assert {a[0] for a in argvs if a} >= {"plan", "train", "cost", "simulate", "doctor",
                                          "calibrate", "export", "merge"}


@pytest.mark.parametrize("cmd", [c for c in fenced_commands() if meshtron_argv(c)],
                         ids=lambda c: c.where)
def test_documented_command_parses(cmd: Command):
    """Every documented meshtron command line is accepted by the real parser (a renamed or
    removed flag, or a value of the wrong type, fails here)."""
    from meshtron.cli import build_parser
    from meshtron.errors import UserError

    argv = meshtron_argv(cmd)
    try:
        build_parser(argv[0]).parse_args(argv)
    except (UserError, SystemExit) as exc:
        pytest.fail(f"{cmd.where}: `{cmd.text}` does not parse: {exc}")


def test_every_flag_the_docs_name_exists():
    """Each `--flag` in a code span of the prose is an option of the meshtron subcommand the
    span runs, or of the bench script it runs; a flag named alone is an option of some
    subcommand or bench script, or a documented other program's (FOREIGN_FLAGS)."""
    subs = _subcommands()
    benches = {p: p.read_text() for p in (ROOT / "bench").glob("*.py")}
    anywhere = ({o for p in subs.values() for o in p._option_string_actions} | set(FOREIGN_FLAGS)
                | {f for src in benches.values() for f in re.findall(r'"(--[a-z][\w-]*)"', src)})
    bad = []
    for path in DOCS:
        for line, span in inline_spans(path):
            sub = re.match(r"(?:\.venv/bin/)?meshtron ([a-z]+)", span)
            bench = re.match(r"(?:\S*python )?(bench/\w+\.py)", span)
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span):
                if sub and sub.group(1) in subs:
                    ok = flag in subs[sub.group(1)]._option_string_actions
                elif bench:
                    ok = f'"{flag}"' in benches[ROOT / bench.group(1)]
                else:
                    ok = flag in anywhere
                if not ok:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {flag} in `{span[:80]}`")
    assert not bad, "\n".join(bad)


def test_inline_commands_name_real_subcommands():
    subs = _subcommands()
    bad = [f"{c.where}: `{c.text}`" for c in inline_meshtron_spans()
           if c.text.split()[1] not in subs]
    assert not bad, bad


def test_every_subcommand_help_renders():
    """`meshtron SUB --help` for every subcommand (the reference page is generated from it)."""
    for name, parser in _subcommands().items():
        assert f"usage: meshtron {name}" in parser.format_help()


def test_documented_bench_scripts_and_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    for cmd in fenced_commands() + inline_meshtron_spans():
        words = cmd.text.split()
        if words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, re.M), cmd.where
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))):
        for script in re.findall(r"\b(bench/[\w/]+\.py|tests/[\w/]+\.py)", path.read_text()):
            assert (ROOT / script).is_file(), f"{path.relative_to(ROOT)}: {script}"


def _toml_blocks():
    for path in sorted((ROOT / "docs").rglob("*.md")):
        text = path.read_text()
        for m in re.finditer(r"^```toml\n(.*?)^```", text, re.S | re.M):
            yield f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}", m.group(1)


@pytest.mark.parametrize("where,body", list(_toml_blocks()), ids=lambda x: x[:40])
def test_documented_toml_files_load(where, body, tmp_path):
    """Each TOML example (plan file, cluster file, --options file, run file) loads with the
    loader its command uses and passes that loader's checks."""
    import tomllib

    path = tmp_path / "example.toml"
    path.write_text(body)
    doc = tomllib.loads(body)
    if str(doc.get("format", "")).startswith("meshtron-plan"):
        from meshtron.planner.plan import load_plan

        plan = load_plan(path)
        assert plan.gpus == plan.tp * plan.cp * plan.pp * plan.dp, where
    elif "gpus_per_node" in doc:
        from meshtron.planner.cluster import resolve_cluster

        assert resolve_cluster(str(path)).num_gpus == doc["gpus_per_node"] * doc["nodes"]
    elif "options" in doc:
        from meshtron.planner import frameworks

        frameworks.resolve(None, path)
    elif "data" in doc or "train" in doc:
        from meshtron.config import config_from_dict

        config_from_dict(doc)
    else:
        pytest.fail(f"{where}: a TOML example of no known kind")


HF_CONFIG = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "tie_word_embeddings": False}
"""What `path/to/config.json` stands for in plan.md: a Llama-3-70B-shaped Hugging Face config."""
MISTRAL_CONFIG = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                  "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False}
"""What `path/to/mistral/config.json` stands for in long-context.md: Mistral-7B-v0.1's config
(a 4096-token window in every block)."""

EXPECTED_RC = {"doctor --nccl-log": 3}  # the fixture logs show errors: exit 3 (diagnose.md)
SLOW_ONLY = {"--gpus": "a 9-size sweep re-plans at every size (183 CPU s, 2026-12-07)",
             "runs/calibration/": "needs `meshtron calibrate --nproc 4` first (4 torch ranks)"}
SLOW_REPEATS = {  # command as typed -> the default test that runs its search and its table
    ".venv/bin/meshtron plan --model llama3-70b --cluster dgx-h100:64 --global-batch 1024 "
    "--seq-len 8192 --tokens 15T":
        "README.md's next line, the same search saved (--save plan.toml, read by economize.md's "
        "cost --plan); its --tokens table: tests/test_planner.py::"
        "test_default_table_fits_100_columns_without_ellipsis[argv0]",
    ".venv/bin/meshtron plan --model llama3-70b --cluster dgx-h100:16 --global-batch 1024 "
    "--seq-len 8192 --tokens 15T":
        "tests/test_planner.py::test_default_table_fits_100_columns_without_ellipsis[argv0], "
        "this search and its table at 100 columns",
    ".venv/bin/meshtron plan --model llama3-405b --cluster dgx-h100:2048 --global-batch 2048 "
    "--seq-len 8192":
        "tests/test_planner.py::test_default_table_fits_100_columns_without_ellipsis[argv1], "
        "this search and its table (with a --tokens column) at 100 columns",
}
"""Documented commands run by the slow test only (suite time, session 57: 7.7, 9.5 and 3.5 s
of one core each): each repeats a search a default test runs, with its table checked there.
Matched on the whole command: a changed line runs in the default test again."""


def _user_folder(tmp_path: Path) -> Path:
    """A run folder as a user has it after `make`: `.venv/bin/meshtron`, the files the docs
    name (their TOML examples, a config.json, NCCL logs)."""
    import json

    venv = Path(sys.prefix)
    assert (venv / "bin" / "meshtron").exists(), \
        "no meshtron console script in this environment: run the suite through `make test`"
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / ".venv").symlink_to(venv)
    (tmp_path / "path/to").mkdir(parents=True)
    (tmp_path / "path/to/config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "path/to/mistral").mkdir()
    (tmp_path / "path/to/mistral/config.json").write_text(json.dumps(MISTRAL_CONFIG))
    for _, body in _toml_blocks():
        if "gpus_per_node" in body:
            (tmp_path / "my-cluster.toml").write_text(body)
        elif "[options]" in body:
            (tmp_path / "my-stack.toml").write_text(body)
    for i, log in enumerate(sorted((ROOT / "tests/data/nccl").glob("bad_gpu-*.log")), 1):
        (tmp_path / f"node{i}.log").write_text(log.read_text())
    return tmp_path


def _runnable(slow: bool) -> list[Command]:
    seen, out = set(), []
    for cmd in fenced_commands():
        argv = meshtron_argv(cmd)
        if not argv or argv[0] not in CHEAP or cmd.text in seen:
            continue
        if argv[0] == "doctor" and "--nccl-log" not in argv:
            continue  # reads a hung run's folder: NOT_RUN
        if (any(k in cmd.text for k in SLOW_ONLY) or cmd.text in SLOW_REPEATS) != slow:
            continue
        seen.add(cmd.text)
        out.append(cmd)
    return out


def _chains(cmds: list[Command]) -> list[list[int]]:
    """The commands (indexes, document order) cut into chains that share no file: a command
    naming a file an earlier one writes (`--save F`, `--out F`) runs after it in its chain
    (README's `--save plan.toml` feeds economize.md's `cost --plan plan.toml`); the others
    start chains."""
    chains: list[list[int]] = []
    writer: dict[str, int] = {}  # file -> the chain whose command saves it
    for i, cmd in enumerate(cmds):
        words = cmd.text.split()
        chain = next((writer[w] for w in words if w in writer), None)
        if chain is None:
            chains.append([])
            chain = len(chains) - 1
        chains[chain].append(i)
        for flag, value in zip(words, words[1:]):
            if flag in ("--save", "--out"):
                writer[value] = chain
    return chains


def _run_one(cmd: Command, folder: Path) -> list[str]:
    """Run one command as typed; its failures, one line each."""
    import time

    start = time.monotonic()
    # 900 s: the slow test's sweep takes 183 CPU s (session 57; it timed out at 300 s of wall
    # twice at load 4-8)
    proc = subprocess.run(["bash", "-c", cmd.text], cwd=folder, capture_output=True,
                          text=True, timeout=900)
    took = time.monotonic() - start
    want = next((rc for k, rc in EXPECTED_RC.items() if k in cmd.text), 0)
    print(f"{cmd.where}: exit {proc.returncode} in {took:.1f} s: {cmd.text}")
    if proc.returncode != want:
        return [f"{cmd.where}: exit {proc.returncode} (want {want}): {cmd.text}\n"
                f"{proc.stderr[-800:]}"]
    if "Traceback" in proc.stderr:
        return [f"{cmd.where}: a traceback: {proc.stderr[-800:]}"]
    if meshtron_argv(cmd)[0] == "plan" and "--json" not in cmd.text:
        return [f"{cmd.where}: {problem}" for problem in _table_problems(proc.stdout)]
    return []


def _run_documented(cmds: list[Command], folder: Path) -> list[str]:
    """Run each command as typed in one folder, a command after any whose `--save` file it
    names (_chains); the failures, one line each, in document order. Two chains at a time:
    each command is one single-threaded Python process (the planner's search: user time
    equals its wall time on an idle core), so on the 2-core CI machine the second core takes
    half of the test's wall time."""
    from concurrent.futures import ThreadPoolExecutor

    def run_chain(chain: list[int]) -> dict[int, list[str]]:
        return {i: _run_one(cmds[i], folder) for i in chain}

    bad: dict[int, list[str]] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for result in pool.map(run_chain, _chains(cmds)):
            bad.update(result)
    return [line for i in sorted(bad) for line in bad[i]]


def _table_problems(text: str) -> list[str]:
    """`meshtron plan`'s text fits 100 columns off a terminal and no figure of its table is
    folded over two lines (a row continued on the next line has nothing in its first
    columns; plan.md: "a ranked table that fits 100 columns", "numbers are never cut")."""
    out = [f"line over 100 columns: {line!r}" for line in text.splitlines() if len(line) > 100]
    lines = text.splitlines()
    for prev, line in zip(lines, lines[1:]):
        if re.match(r" ?\d+ ", prev) and re.match(r" {20,}\S", line):
            out.append(f"a table row folded: {prev!r} / {line!r}")
    return out


def test_cheap_documented_commands_run(tmp_path):
    """The torch-free commands the docs show (plan, cost, simulate --step, doctor --nccl-log:
    ~15 s in all) run as typed from a user's folder and exit as documented; NOT_RUN says why
    the others are only parsed (test_documented_command_parses), SLOW_REPEATS which run in the
    slow test only."""
    cmds = _runnable(slow=False)
    repeats = [c for c in _runnable(slow=True) if c.text in SLOW_REPEATS]
    assert len(repeats) == len(SLOW_REPEATS), [c.where for c in repeats]  # none stale
    assert len(cmds) + len(repeats) >= 10, [c.where for c in cmds]
    bad = _run_documented(cmds, _user_folder(tmp_path))
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_slow_documented_commands_run(tmp_path):
    """The rest of the torch-free commands: the calibration they need first, the sweep, and
    SLOW_REPEATS."""
    folder = _user_folder(tmp_path)
    cal = subprocess.run([str(folder / ".venv/bin/meshtron"), "calibrate", "--nproc", "4"],
                         cwd=folder, capture_output=True, text=True, timeout=600)
    assert cal.returncode == 0, cal.stderr[-2000:]
    bad = _run_documented(_runnable(slow=True), folder)
    assert not bad, "\n".join(bad)


TRAIN_SKIPPED = {"--nproc 8": "8 ranks: more than a CI machine runs at once",
                 "--nnodes": "elastic: one agent per node", "path/to/": "a Hugging Face folder",
                 "--plan plan.toml": "a saved plan of the user's own cluster",
                 "merged/": "needs `meshtron merge` of trained runs"}


@pytest.mark.slow
def test_documented_train_commands_run(tmp_path):
    """Every documented `meshtron train` line that fits one machine runs as typed with
    `--steps 2` added (`...` dropped), one folder per page, in page order: a line naming its
    `--run-dir` shares it with the page's other lines (the README's tour resumes the run it
    trained), a line naming none gets its own (the page lists alternatives). TRAIN_SKIPPED says
    why the rest do not run (all of them parse: test_documented_command_parses)."""
    import tomllib

    bad, seen = [], set()
    for n, doc in enumerate(dict.fromkeys(c.doc for c in fenced_commands())):
        folder = _user_folder(tmp_path / f"page{n}")
        for _, body in _toml_blocks():
            if "data" in tomllib.loads(body):
                (folder / "run.toml").write_text(body)
        for i, cmd in enumerate(c for c in fenced_commands() if c.doc == doc):
            argv = meshtron_argv(cmd)
            if not argv or argv[0] != "train" or cmd.text in seen:
                continue
            if (any(k in cmd.text for k in TRAIN_SKIPPED)
                    or cmd.text.startswith(("torchrun", "srun"))):
                continue
            seen.add(cmd.text)
            text = cmd.text.replace(" ...", "") + " --steps 2"
            if "--run-dir" not in text and "--config" not in text:
                text += f" --run-dir runs/line{cmd.line}"
            bad += _run_documented([Command(cmd.doc, cmd.line, text)], folder)
    assert not bad, "\n".join(bad)


def test_install_lines_name_every_dependency_but_torch():
    """The GPU-cluster install (`pip install --no-deps -e .` then the rest by hand) names
    every dependency of pyproject.toml except torch, which the cluster's image keeps."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {re.split(r"[<>=\[ ]", d)[0] for d in deps} - {"torch"}
    for doc in ("README.md", "docs/getting-started.md"):
        named = {re.split(r"[<>=\[]", w.strip("'"))[0] for c in fenced_commands()
                 if c.doc == doc and c.text.startswith("pip install") for w in c.words()[2:]}
        assert wanted <= named, (doc, wanted - named)
