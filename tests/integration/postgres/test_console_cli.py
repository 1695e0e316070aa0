"""``rselection web`` as an operator starts it: it serves the console on the address
given, read-only or with a token file; refuses an empty token file; says what to
install when the web extra is missing; and never prints a password."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from tests.support.backends import closed_port
from tests.support.resign_cli import cli

SECRET = "pw-Zx81"


def get(url: str, **headers: str) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def post(url: str, **headers: str) -> int:
    request = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def started(port: int, process: subprocess.Popen[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            if get(f"http://127.0.0.1:{port}/")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("the console did not answer")


def test_rselection_web_serves_the_console_and_acts_only_with_the_token(
    pg_dsn: str, tmp_path: Path
) -> None:
    assert cli("migrate", "--dsn", pg_dsn).returncode == 0
    parts = urlsplit(pg_dsn)
    dsn = urlunsplit(parts._replace(netloc=f"postgres:{SECRET}@{parts.hostname}:{parts.port}"))
    token = tmp_path / "token"
    token.write_text("\n  op-secret-token \n")
    port = closed_port()
    command = ["web", "--dsn", dsn, "--bind", f"127.0.0.1:{port}", "--token-file", str(token)]
    command += ["--allow-host", "console.example", "--allow-host", "ops.example:8443"]
    process = subprocess.Popen(
        [sys.executable, "-m", "rselection", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        started(port, process)
        status, text = get(f"http://127.0.0.1:{port}/api/status")
        assert status == 200 and SECRET not in text
        route = f"http://127.0.0.1:{port}/api/leases/none/step-down"
        assert post(route) == 401
        assert post(route, authorization="Bearer op-secret-token") == 409  # no such lease
        login = f"http://127.0.0.1:{port}/login"
        for allowed in ("console.example", f"console.example:{port}", "ops.example:8443"):
            assert get(login, host=allowed)[0] == 200, allowed
        for refused in ("rebound.example", f"rebound.example:{port}", "ops.example:80"):
            assert get(login, host=refused)[0] == 400, refused
    finally:
        process.terminate()
        out, err = process.communicate(timeout=20)
    assert f"http://127.0.0.1:{port}/" in out and "operator token required" in out
    assert SECRET not in out + err


def test_an_empty_token_file_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text(" \n")
    done = cli("web", "--dsn", pg_dsn, "--token-file", str(empty))
    assert done.returncode == 2 and "is empty" in done.stderr


def test_a_token_file_with_a_bom_works_and_a_non_ascii_token_is_refused(
    pg_dsn: str, tmp_path: Path
) -> None:
    assert cli("migrate", "--dsn", pg_dsn).returncode == 0
    bom = tmp_path / "bom"
    bom.write_bytes("\ufeffop-token\r\n".encode())  # as some editors save it
    port = closed_port()
    command = ["web", "--dsn", pg_dsn, "--bind", f"127.0.0.1:{port}", "--token-file", str(bom)]
    process = subprocess.Popen(
        [sys.executable, "-m", "rselection", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        started(port, process)
        route = f"http://127.0.0.1:{port}/api/leases/none/step-down"
        assert post(route, authorization="Bearer op-token") == 409  # no such lease
    finally:
        process.terminate()
        process.wait(timeout=20)
    accented = tmp_path / "accented"
    accented.write_text("tökén\n", encoding="utf-8")  # no bearer header can carry it
    done = cli("web", "--dsn", pg_dsn, "--token-file", str(accented), timeout=30)
    assert done.returncode == 2 and "printable ASCII" in done.stderr


def test_a_missing_web_extra_says_what_to_install(pg_dsn: str) -> None:
    hide = "import sys; sys.modules['uvicorn'] = None; from rselection.cli import main; "
    done = subprocess.run(
        [sys.executable, "-c", hide + f"sys.exit(main(['web', '--dsn', {pg_dsn!r}]))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "pip install 'rselection[web]'" in done.stderr


def test_an_unreachable_database_exits_3_without_the_password() -> None:
    dsn = f"postgresql://postgres:{SECRET}@127.0.0.1:{closed_port()}/test"
    done = cli("web", "--dsn", dsn, "--bind", f"127.0.0.1:{closed_port()}")
    assert done.returncode == 3 and SECRET not in done.stdout + done.stderr
