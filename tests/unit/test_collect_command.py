"""``nemo-gym-ckpt collect`` before it starts anything: flags, nothing left, refusals, overrides."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import orjson
import pytest

from nemo_gym_ckpt.cli import collect
from nemo_gym_ckpt.collect.published import CollectionManifest, publish
from nemo_gym_ckpt.collect.rows import read_jsonl
from nemo_gym_ckpt.config import PROJECT_ROOT, load_config

pytestmark = pytest.mark.unit

QUICKSTART = PROJECT_ROOT / "configs" / "quickstart.yaml"
DATASET = PROJECT_ROOT / "resources_servers" / "calculator_tools" / "data" / "quickstart.jsonl"


def args_for(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    collect.configure(parser)
    return parser.parse_args(list(argv))


def finished_rows(output: Path, count: int) -> None:
    tasks = list(read_jsonl(DATASET))[:count]
    output.write_bytes(b"".join(orjson.dumps({**task, "reward": 1.0, "_ng_task_index": index,
                                              "_ng_rollout_index": 0, "_ng_attempt_index": 0}) + b"\n"
                                for index, task in enumerate(tasks)))


def test_a_run_with_nothing_left_exits_0_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "rows.jsonl"
    finished_rows(output, 3)
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(output), "--limit", "3",
                                   "--checkpoint-dir", str(tmp_path / "ckpt")))
    assert status == 0 and f"nothing left: all 3 rollouts are in {output}" in capsys.readouterr().out
    assert not (tmp_path / "rows_servers.log").exists()  # no mesh was launched
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_of_another_config_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "ckpt"
    checkpoint = "ckpt-20260101T000000000000Z-0123abcd"
    (directory / checkpoint / "gym/model/policy_model").mkdir(parents=True)
    (directory / checkpoint / "gym/model/policy_model/manifest.json").write_bytes(b"{}")
    publish(directory, CollectionManifest(
        checkpoint_id=checkpoint, run_id="run-x", created_at="2026-01-01T00:00:00.000Z", continued=["0-0"],
        restarted=[], rows_done=0, config_digest="0" * 64, input_digest="1" * 64, num_repeats=1,
        manifests={"policy_model": "gym/model/policy_model/manifest.json"}))
    before = sorted(str(p) for p in directory.rglob("*"))
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(tmp_path / "rows.jsonl"),
                                   "--limit", "3", "--checkpoint-dir", str(directory)))
    err = capsys.readouterr().err
    assert status == 2 and "was taken with another config" in err and "another --checkpoint-dir" in err
    assert sorted(str(p) for p in directory.rglob("*")) == before
    assert not (tmp_path / "rows_servers.log").exists()


def test_a_collection_json_with_a_wrong_type_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "ckpt"
    checkpoint = "ckpt-20260101T000000000000Z-0123abcd"
    (directory / checkpoint / "gym/model/policy_model").mkdir(parents=True)
    (directory / checkpoint / "gym/model/policy_model/manifest.json").write_bytes(b"{}")
    publish(directory, CollectionManifest(
        checkpoint_id=checkpoint, run_id="run-x", created_at="2026-01-01T00:00:00.000Z", continued=["0-0"],
        restarted=[], rows_done=0, config_digest="0" * 64, input_digest="1" * 64, num_repeats=1,
        manifests={"policy_model": "gym/model/policy_model/manifest.json"}))
    path = directory / checkpoint / "collection.json"
    path.write_bytes(path.read_bytes().replace(b'"rows_done": 0', b'"rows_done": "zero"'))
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(tmp_path / "rows.jsonl"),
                                   "--limit", "3", "--checkpoint-dir", str(directory)))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"{path} is not a collection manifest: rows_done" in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--head", "http://127.0.0.1:9", "--checkpoint-every-s", "5"], "need --checkpoint-dir"),
    (["--config", str(QUICKSTART), "--token", "t"], "need --checkpoint-dir"),
    (["x=1"], "pass --config CONFIG"),
])
def test_flag_combinations_that_cannot_work_are_usage_errors(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert collect.main(args_for(*argv, "--output", str(tmp_path / "o.jsonl"))) == 2
    assert message in capsys.readouterr().err


def test_a_head_mesh_needs_its_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(collect.TOKEN_ENV, raising=False)
    with pytest.raises(collect.UsageError, match="GYM_CKPT_TOKEN"):
        collect._head_token(args_for("--head", "http://h", "--output", "o", "--checkpoint-dir", "d"))
    monkeypatch.setenv(collect.TOKEN_ENV, "from-env")
    assert collect._head_token(args_for("--head", "http://h", "--output", "o", "--checkpoint-dir", "d")) == (
        "from-env")


def test_a_launched_mesh_gets_checkpointing_into_the_directory(tmp_path: Path) -> None:
    mesh = load_config([QUICKSTART])
    overrides = collect.checkpoint_overrides(mesh, tmp_path / "ckpt")
    assert overrides[:2] == ["checkpoint.enabled=true", f"checkpoint.root='{tmp_path / 'ckpt'}'"]
    token = overrides[2].split("=", 1)[1]
    assert token.startswith("ng-") and len(token) == 35
    assert collect.checkpoint_overrides(mesh, tmp_path / "ckpt")[2] != overrides[2]  # fresh each time
    enabled = load_config([QUICKSTART], [*overrides])
    assert enabled.checkpoint.enabled and enabled.checkpoint.root == tmp_path / "ckpt"
    assert collect.checkpoint_overrides(enabled, tmp_path / "ckpt" / "run") == []  # the config's own
    with pytest.raises(collect.UsageError, match=r"not inside the config's checkpoint\.root"):
        collect.checkpoint_overrides(enabled, tmp_path / "elsewhere")


@pytest.mark.parametrize("name", ["a,b", "[x]", "it's", "yes", "017", "~x", "a=b", "a\\", "#1 $x é"])
def test_a_checkpoint_directory_of_any_name_reaches_the_config_unchanged(tmp_path: Path, name: str) -> None:
    """The override is quoted: Hydra's grammar (which reads overrides, as NeMo Gym's does) would read a bare
    path with a comma as a sweep, brackets as a list, and refuse a quote, a ~ or an =."""
    directory = tmp_path / name / "ckpt"
    enabled = load_config([QUICKSTART], collect.checkpoint_overrides(load_config([QUICKSTART]), directory))
    assert enabled.checkpoint.root == directory


def test_a_damaged_latest_pointer_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "LATEST").write_bytes(b"\xff\xfe garbage")
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(tmp_path / "rows.jsonl"),
                                   "--limit", "2", "--checkpoint-dir", str(directory)))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"{directory / 'LATEST'} does not name a checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "rows_servers.log").exists()  # no mesh was launched


def test_a_damaged_line_in_the_output_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "rows.jsonl"
    output.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n\x00\x00\x00\x00\n')
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(output), "--limit", "2",
                                   "--checkpoint-dir", str(tmp_path / "ckpt")))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"{output}, line 2: not a JSON object" in err and "Traceback" not in err
    assert not (tmp_path / "rows_servers.log").exists()  # no mesh was launched


def test_a_damaged_line_in_the_dispatch_log_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    damaged = b'{"rollout_id": "0-0", "attempt": 0}\n{"rollout_id": "1-0", "attem\n'
    (directory / "dispatched.jsonl").write_bytes(damaged)
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(tmp_path / "rows.jsonl"),
                                   "--limit", "2", "--checkpoint-dir", str(directory)))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"{directory / 'dispatched.jsonl'}, line 2: not a JSON object" in err and "Traceback" not in err
    assert not (tmp_path / "rows_servers.log").exists()  # no mesh was launched


def not_a_regular_file(path: Path, kind: str) -> None:
    """A FIFO (a blocking read would wait for a writer for ever) or a symlink to a character device."""
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/null")


@pytest.mark.timeout(10)  # the code before this check waited on the FIFO until the timeout
@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("which", ["output", "dispatch log"])
def test_an_output_or_dispatch_log_that_is_not_a_regular_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str, kind: str,
) -> None:
    directory, output = tmp_path / "ckpt", tmp_path / "rows.jsonl"
    directory.mkdir()
    path = output if which == "output" else directory / "dispatched.jsonl"
    not_a_regular_file(path, kind)
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(output), "--limit", "2",
                                   "--checkpoint-dir", str(directory)))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    what = "a FIFO" if kind == "fifo" else "a character device"
    assert f"{path}: not a regular file ({what})" in err and "Traceback" not in err
    assert not (tmp_path / "rows_servers.log").exists()  # no mesh was launched


@pytest.mark.timeout(10)
def test_an_input_that_is_a_fifo_is_refused_saying_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks.jsonl"
    os.mkfifo(tasks)  # what --input <(cmd) hands over: its rows could be read only once
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(tmp_path / "rows.jsonl"),
                                   "--input", str(tasks)))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"input {tasks} is not a regular file" in err and "write them to a file" in err


@pytest.mark.timeout(10)  # the code before this check blocked in open() until a reader came
def test_a_server_log_fifo_that_nobody_reads_is_refused_before_the_mesh_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "rows_servers.log")
    status = collect.main(args_for("--config", str(QUICKSTART), "--output", str(tmp_path / "rows.jsonl"),
                                   "--limit", "1"))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "rows_servers.log" in err and "a FIFO that no process reads" in err
