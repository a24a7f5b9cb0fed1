"""Pytest fixtures for a real S3-compatible server: moto's standalone server on loopback.

Mocking boto calls in-process would not exercise s3fs's HTTP path (listing, multipart,
error translation), so the tests talk to ``moto.server`` over HTTP on 127.0.0.1, like they
would to MinIO or S3. The server starts once per session on a free port with fake
credentials; the bucket is made with boto3 because s3fs's ``mkdir`` trips on the region
constraint. A missing moto/s3fs/boto3 fails the tests loudly: CI installs them, and a silent
skip would hide that the S3 path went untested.

Import the fixtures into a test module (``from support.s3_server import s3_bucket, s3_endpoint``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

REGION = "us-east-1"
BUCKET = "clew-test-bucket"
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    # Keep a developer's real ~/.aws profile and endpoint out of the tests.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_UNSET = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as fh:
                pytest.fail(f"moto_server exited with {proc.returncode}:\n{fh.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answered: up, whatever the status
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"moto_server did not answer on {url} within {timeout:.0f}s")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server on 127.0.0.1, with fake AWS credentials in the environment."""
    missing = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(
            f"S3 tests need {', '.join(missing)}: pip install -e '.[dev,s3]'", pytrace=False
        )
    patch = pytest.MonkeyPatch()
    for key, value in FAKE_AWS_ENV.items():
        patch.setenv(key, value)
    for key in _UNSET:
        patch.delenv(key, raising=False)
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = os.path.join(tempfile.mkdtemp(prefix="moto-"), "server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_ready(proc, f"{endpoint}/moto-api/", log_path, timeout=30)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(os.path.dirname(log_path), ignore_errors=True)
        patch.undo()


@pytest.fixture(scope="session")
def s3_bucket(s3_endpoint: str) -> str:
    """Name of a bucket on the moto server; tests share it and use unique prefixes."""
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, region_name=REGION).create_bucket(Bucket=BUCKET)
    return BUCKET
