"""The fresh venv's side of .ci/check-install: run by that venv's python, outside the repository, stdlib only.

    python check_install.py imports                  every module of the installed mlxpipe imports
    python check_install.py version                  `mlxpipe --version` names the installed version
    python check_install.py ready BASE PID           /health says ready (PID: the server, which must not exit)
    python check_install.py chat BASE KEY [IMAGE]    one chat answer from /v1/chat/completions (IMAGE: a PNG sent
                                                     as an OpenAI image_url data: URI part)

Each prints one line of what it proved, or says what failed and exits 1.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

READY_SECONDS = 300.0  # two ranks loading on a busy 2-core machine
ANSWER_SECONDS = 300.0
# What only the vision extra brings: a plain install imports every module without them (they wait inside the
# functions that vision/prompt.py's refusal guards).
VISION_ONLY = ("mlx_vlm", "PIL")


def fail(message: str) -> None:
    print(f"FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def imports() -> None:
    import mlxpipe

    here = Path(mlxpipe.__file__).resolve()
    if not here.is_relative_to(Path(sys.prefix).resolve()):
        fail(f"mlxpipe imported from {here}, not from the venv at {sys.prefix}")
    broken: list[str] = []

    def onerror(name: str) -> None:
        broken.append(f"{name}: {sys.exc_info()[1]!r}")

    count = 0
    for module in pkgutil.walk_packages(mlxpipe.__path__, "mlxpipe.", onerror=onerror):
        if module.name.rsplit(".", 1)[-1] == "__main__":  # `python -m` entry points: importing one runs it
            continue
        try:
            importlib.import_module(module.name)
            count += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported with its module
            broken.append(f"{module.name}: {type(e).__name__}: {e}")
    if broken:
        fail("modules that do not import on a plain install:\n  " + "\n  ".join(broken))
    loaded = sorted({name.split(".")[0] for name in sys.modules} & set(VISION_ONLY))
    if loaded:
        fail(f"importing mlxpipe loaded {', '.join(loaded)}, which only the vision extra installs")
    print(f"imports: all {count} modules of mlxpipe import without extras (none loads {', '.join(VISION_ONLY)})")


def version() -> None:
    from importlib.metadata import version as installed

    wanted = installed("mlxpipe")
    script = Path(sys.executable).with_name("mlxpipe")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    lines = done.stdout.splitlines()
    if done.returncode != 0 or not lines or lines[0] != f"mlxpipe {wanted}":
        fail(f"`mlxpipe --version` exited {done.returncode} and printed {done.stdout!r} {done.stderr!r}; "
             f"wanted a first line 'mlxpipe {wanted}'")
    print(f"version: `mlxpipe --version` says {lines[0]!r}, as the package metadata does")


def _get(url: str) -> dict[str, object]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:  # 503 while the ranks load: the body says which
        return dict(json.loads(e.read()))


def ready(base: str, pid: int) -> None:
    start = time.monotonic()
    last: dict[str, object] = {}
    while time.monotonic() - start < READY_SECONDS:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            fail(f"mlxpipe serve (pid {pid}) exited before it was ready")
        try:
            last = _get(f"{base}/health")
        except OSError:
            last = {}
        if last.get("status") == "ready":
            print("2 ranks ready")
            return
        time.sleep(0.5)
    fail(f"mlxpipe serve not ready after {READY_SECONDS:g} s (last /health: {last})")


def chat(base: str, key: str, image: str | None) -> None:
    content: object = "Say hello."
    if image:
        uri = "data:image/png;base64," + base64.b64encode(Path(image).read_bytes()).decode()
        content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is it?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=ANSWER_SECONDS) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        fail(f"/v1/chat/completions answered {e.code}: {e.read().decode(errors='replace')}")
    text = answer["choices"][0]["message"]["content"]
    usage = answer["usage"]
    if not isinstance(text, str) or usage["completion_tokens"] < 1:
        fail(f"no answer in {answer}")
    what = "an image and a question" if image else "a question"
    print(f"chat: {what} ({usage['prompt_tokens']} prompt tokens) answered with {usage['completion_tokens']} tokens")


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "imports":
        imports()
    elif command == "version":
        version()
    elif command == "ready":
        ready(args[0], int(args[1]))
    elif command == "chat":
        chat(args[0], args[1], args[2] if len(args) > 2 else None)
    else:
        fail(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
