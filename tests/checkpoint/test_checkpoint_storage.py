"""Checkpoint storage and commit protocol, on local disk and on a real S3-compatible server."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from support.s3_server import s3_bucket, s3_endpoint  # noqa: F401  (fixtures)

from clew.checkpoint import (
    MANIFEST_FILE,
    POINTER_FILE,
    RetryPolicy,
    Storage,
    commit_checkpoint,
    download_checkpoint,
    find_resume_step,
    is_transient,
    join,
    list_steps,
    prune_checkpoints,
    read_pointer,
    step_dir,
    verify_checkpoint,
)
from clew.errors import CheckpointError

FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Storage, str]:
    """(storage, ckpt_path) on local disk or under a fresh prefix of the moto bucket."""
    if request.param == "local":
        root = str(tmp_path / "run" / "ckpts")
        return Storage.for_path(root, retry=FAST), root
    bucket = request.getfixturevalue("s3_bucket")
    endpoint = request.getfixturevalue("s3_endpoint")
    root = f"s3://{bucket}/{uuid.uuid4().hex}/ckpts"
    return Storage.for_path(root, endpoint_url=endpoint, retry=FAST), root


def stage(tmp_path: Path, step: int) -> Path:
    """A staging dir shaped like a trainer's save, with step-dependent contents."""
    root = tmp_path / f"staging_{step}_{uuid.uuid4().hex[:6]}"
    files = {
        "policy/model.safetensors": os.urandom(3000) + bytes([step % 256]),
        "policy/optimizer/rank_0.pt": b"opt" * (100 + step),
        "trainer_state.json": f'{{"global_step": {step}}}'.encode(),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def commit_steps(storage: Storage, ckpt: str, tmp_path: Path, *steps: int) -> None:
    for step in steps:
        commit_checkpoint(storage, ckpt, step, stage(tmp_path, step))


def corrupt(storage: Storage, path: str, how: str) -> None:
    data = storage.fs.cat_file(path)
    data = bytes([data[0] ^ 0xFF]) + data[1:] if how == "flip" else data[: len(data) // 2]
    storage.fs.pipe_file(path, data)


def test_commit_writes_manifest_and_pointer_and_resume_finds_it(backend, tmp_path):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 1, 2)
    assert list_steps(storage, ckpt) == [1, 2]
    assert storage.read_text(join(ckpt, POINTER_FILE)).strip() == "2"
    assert verify_checkpoint(storage, step_dir(ckpt, 2)) == []
    files = storage.list_files(step_dir(ckpt, 2))
    assert set(files) == {
        MANIFEST_FILE,
        "policy/model.safetensors",
        "policy/optimizer/rank_0.pt",
        "trainer_state.json",
    }
    assert find_resume_step(storage, ckpt) == (2, [])


def test_download_round_trips_and_checks_hashes(backend, tmp_path):
    storage, ckpt = backend
    staged = stage(tmp_path, 7)
    commit_checkpoint(storage, ckpt, 7, staged)
    out = tmp_path / "restored"
    manifest = download_checkpoint(storage, step_dir(ckpt, 7), out)
    assert manifest["step"] == 7
    for entry in manifest["files"]:
        assert (out / entry["path"]).read_bytes() == (staged / entry["path"]).read_bytes()


def test_download_of_corrupt_step_lists_mismatches(backend, tmp_path):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 3)
    corrupt(storage, join(step_dir(ckpt, 3), "trainer_state.json"), "flip")
    with pytest.raises(CheckpointError, match="checksum mismatch for trainer_state.json"):
        download_checkpoint(storage, step_dir(ckpt, 3), tmp_path / "restored")


def test_failed_upload_leaves_pointer_on_previous_step(backend, tmp_path, monkeypatch):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 1)
    real_put = storage.put_file
    uploaded: list[str] = []

    def dies_after_one_file(local: Any, remote: str) -> None:
        if uploaded:
            raise RuntimeError("node lost mid-upload")
        real_put(local, remote)
        uploaded.append(remote)

    monkeypatch.setattr(storage, "put_file", dies_after_one_file)
    with pytest.raises(RuntimeError, match="mid-upload"):
        commit_checkpoint(storage, ckpt, 2, stage(tmp_path, 2))
    monkeypatch.undo()
    assert uploaded, "the failure must come after part of the upload"
    assert read_pointer(storage, ckpt) == 1
    assert verify_checkpoint(storage, step_dir(ckpt, 2)) != []
    assert find_resume_step(storage, ckpt) == (1, [])


def test_manifest_then_pointer_are_the_last_writes(backend, tmp_path, monkeypatch):
    storage, ckpt = backend
    writes: list[str] = []
    for name in ("put_file", "write_text"):
        real = getattr(storage, name)

        def spy(a: Any, b: Any, _real: Any = real, _name: str = name) -> None:
            writes.append(str(b) if _name == "put_file" else str(a))
            _real(a, b)

        monkeypatch.setattr(storage, name, spy)
    commit_steps(storage, ckpt, tmp_path, 1)
    assert writes[-1] == join(ckpt, POINTER_FILE)
    assert writes[-2].endswith("/" + MANIFEST_FILE)
    assert len(writes) == 5  # three data files, manifest, pointer


def test_half_written_step_without_manifest_is_never_chosen(backend, tmp_path):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 1)
    storage.put_file(stage(tmp_path, 2) / "trainer_state.json", join(step_dir(ckpt, 2), "t.json"))
    storage.rm_tree(join(ckpt, POINTER_FILE))
    step, warnings = find_resume_step(storage, ckpt)
    assert step == 1
    assert any("step 2" in w and MANIFEST_FILE in w for w in warnings)
    assert any(POINTER_FILE in w for w in warnings)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupted_latest_falls_back_to_previous_step_with_warning(backend, tmp_path, how):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 1, 2)
    corrupt(storage, join(step_dir(ckpt, 2), "policy/model.safetensors"), how)
    problems = verify_checkpoint(storage, step_dir(ckpt, 2))
    expected = "checksum mismatch" if how == "flip" else "size mismatch"
    assert len(problems) == 1 and expected in problems[0]
    step, warnings = find_resume_step(storage, ckpt)
    assert step == 1
    assert any("step 2" in w and expected in w for w in warnings)


def test_pointer_to_missing_step_falls_back(backend, tmp_path):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 1, 2)
    storage.rm_tree(step_dir(ckpt, 2))
    step, warnings = find_resume_step(storage, ckpt)
    assert step == 1
    assert any("step 2" in w and "does not exist" in w for w in warnings)


def test_missing_pointer_uses_newest_complete_step_with_warning(backend, tmp_path):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 1, 2)
    storage.rm_tree(join(ckpt, POINTER_FILE))
    step, warnings = find_resume_step(storage, ckpt)
    assert step == 2
    assert POINTER_FILE in warnings[0] and "step 2" in warnings[-1]


def test_empty_checkpoint_path_resumes_nothing(backend):
    storage, ckpt = backend
    assert find_resume_step(storage, ckpt) == (None, [])


def test_recommitting_a_step_replaces_it(backend, tmp_path):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 5)
    storage.put_file(stage(tmp_path, 0) / "trainer_state.json", join(step_dir(ckpt, 5), "old"))
    staged = stage(tmp_path, 5)
    commit_checkpoint(storage, ckpt, 5, staged)
    assert "old" not in storage.list_files(step_dir(ckpt, 5))
    assert verify_checkpoint(storage, step_dir(ckpt, 5)) == []
    assert storage.list_dirs(ckpt) == ["global_step_5"]


def test_retention_keeps_newest_and_never_the_pointed_step(backend, tmp_path):
    storage, ckpt = backend
    commit_steps(storage, ckpt, tmp_path, 1, 2, 3, 4)
    storage.write_text(join(ckpt, POINTER_FILE), "1\n")  # e.g. resumed from an old step
    storage.write_text(join(ckpt, "global_step_5.tmp-dead", "x"), "interrupted save")
    assert prune_checkpoints(storage, ckpt, max_to_keep=-1) == [
        join(ckpt, "global_step_5.tmp-dead")
    ]
    assert list_steps(storage, ckpt) == [1, 2, 3, 4]
    prune_checkpoints(storage, ckpt, max_to_keep=2)
    assert list_steps(storage, ckpt) == [1, 3, 4]
    assert storage.list_dirs(ckpt) == ["global_step_1", "global_step_3", "global_step_4"]
    prune_checkpoints(storage, ckpt, max_to_keep=0)
    assert list_steps(storage, ckpt) == [1]
    assert find_resume_step(storage, ckpt) == (1, [])


def test_retention_rejects_a_negative_count(backend):
    storage, ckpt = backend
    with pytest.raises(CheckpointError, match="max_to_keep"):
        prune_checkpoints(storage, ckpt, max_to_keep=-2)


class FlakyFS:
    """Wraps a file system; ``put_file`` raises the queued errors before it works."""

    def __init__(self, fs: Any, errors: list[BaseException]):
        self._fs, self._errors, self.calls = fs, list(errors), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def put_file(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self._errors:
            raise self._errors.pop(0)
        return self._fs.put_file(*args, **kwargs)


def client_error(code: str, status: int) -> OSError:
    """A botocore ClientError as s3fs raises it: translated, with the original as cause."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    err = ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )
    return translate_boto_error(err)


def test_retry_succeeds_after_transient_failures(backend, tmp_path):
    storage, ckpt = backend
    errors = [ConnectionError("reset"), client_error("SlowDown", 503), TimeoutError("slow")]
    storage.fs = flaky = FlakyFS(storage.fs, errors)
    src = stage(tmp_path, 1) / "trainer_state.json"
    storage.put_file(src, join(ckpt, "f.json"))
    assert flaky.calls == 4
    assert storage.read_text(join(ckpt, "f.json")) == src.read_text()


def test_retry_gives_up_with_a_checkpoint_error(backend, tmp_path):
    storage, ckpt = backend
    storage.fs = flaky = FlakyFS(storage.fs, [client_error("InternalError", 500)] * 10)
    with pytest.raises(CheckpointError, match="gave up after 4 attempts"):
        storage.put_file(stage(tmp_path, 1) / "trainer_state.json", join(ckpt, "f.json"))
    assert flaky.calls == FAST.attempts


@pytest.mark.parametrize(
    "error, raised",
    [
        (FileNotFoundError("no such key"), FileNotFoundError),
        (client_error("NoSuchKey", 404), FileNotFoundError),
        (client_error("AccessDenied", 403), CheckpointError),
        (client_error("NoSuchBucket", 404), CheckpointError),
    ],
)
def test_permanent_errors_are_not_retried(backend, tmp_path, error, raised):
    storage, ckpt = backend
    storage.fs = flaky = FlakyFS(storage.fs, [error] * 10)
    with pytest.raises(raised):
        storage.put_file(stage(tmp_path, 1) / "trainer_state.json", join(ckpt, "f.json"))
    assert flaky.calls == 1


@pytest.mark.parametrize(
    "error, transient",
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (client_error("SlowDown", 503), True),
        (client_error("ServiceUnavailable", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("BadGateway", 502), True),
        (client_error("TooManyRequests", 429), True),
        (client_error("AccessDenied", 403), False),
        (client_error("NoSuchKey", 404), False),
        (client_error("NoSuchBucket", 404), False),
        (client_error("InvalidArgument", 400), False),
        (ValueError("bug"), False),
        (CheckpointError("user error"), False),
    ],
)
def test_error_classification(error, transient):
    assert is_transient(error) is transient


def test_nonexistent_bucket_gives_a_clear_error(s3_endpoint, tmp_path):  # noqa: F811
    ckpt = "s3://clew-no-such-bucket/run/ckpts"
    storage = Storage.for_path(ckpt, endpoint_url=s3_endpoint, retry=FAST)
    with pytest.raises(CheckpointError, match=r"clew-no-such-bucket.*aws s3 mb"):
        commit_checkpoint(storage, ckpt, 1, stage(tmp_path, 1))
    with pytest.raises(CheckpointError, match="bucket 'clew-no-such-bucket' does not exist"):
        storage.put_file(stage(tmp_path, 1) / "trainer_state.json", join(ckpt, "x"))
    with pytest.raises(CheckpointError, match="clew-no-such-bucket"):
        find_resume_step(storage, ckpt)


def test_endpoint_comes_from_aws_env_vars_and_explicit_option_wins(
    s3_bucket,  # noqa: F811
    s3_endpoint,  # noqa: F811
    monkeypatch,
):
    path = f"s3://{s3_bucket}/{uuid.uuid4().hex}/hello.txt"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # S3-specific one wins
    Storage.for_path(path, retry=FAST).write_text(path, "hi")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    assert Storage.for_path(path, retry=FAST).read_text(path) == "hi"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    explicit = Storage.for_path(path, endpoint_url=s3_endpoint, retry=FAST)
    assert explicit.read_text(path) == "hi"


def test_local_path_under_a_file_gives_a_clear_error(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    ckpt = str(blocker / "ckpts")
    storage = Storage.for_path(ckpt, retry=FAST)
    with pytest.raises(CheckpointError, match=rf"{ckpt}.*is a file.*choose another"):
        commit_checkpoint(storage, ckpt, 1, stage(tmp_path, 1))


def test_unwritable_local_dir_gives_a_clear_error(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    ckpt = str(locked / "ckpts")
    if os.geteuid() == 0:  # root ignores the mode bits: make the mkdir fail as it would
        real_makedirs = os.makedirs

        def denied(path: Any, *args: Any, **kwargs: Any) -> None:
            if str(path).startswith(str(locked)):
                raise PermissionError(13, "Permission denied", str(path))
            real_makedirs(path, *args, **kwargs)

        monkeypatch.setattr(os, "makedirs", denied)
    storage = Storage.for_path(ckpt, retry=FAST)
    with pytest.raises(CheckpointError, match=rf"{ckpt}.*permission denied.*writable"):
        commit_checkpoint(storage, ckpt, 1, stage(tmp_path, 1))


def test_local_paths_accept_file_urls_and_put_get_dir_round_trip(tmp_path):
    src = stage(tmp_path, 1)
    storage = Storage.for_path(f"file://{tmp_path}/store", retry=FAST)
    rels = storage.put_dir(src, f"file://{tmp_path}/store/a")
    assert storage.get_dir(f"{tmp_path}/store/a", tmp_path / "back") == rels
    assert all((tmp_path / "back" / r).read_bytes() == (src / r).read_bytes() for r in rels)
