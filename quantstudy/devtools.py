"""Helpers the tests and benchmarks share for driving the workflow from outside (not used by rules)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path


def copy_checkout(src: str | Path, dest: str | Path) -> Path:
    """Copy a checkout's tracked and new (not ignored) files: what a fresh clone plus local edits holds."""
    src, dest = Path(src), Path(dest)
    files = subprocess.run(["git", "ls-files", "-coz", "--exclude-standard"], cwd=src, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):  # NUL-separated: names with spaces survive
        if (src / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, dest / f)
    return dest


def snakemake(workdir: str | Path, *args: str, cores: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", str(cores), *args], cwd=workdir,
                          capture_output=True, text=True)


def planned_jobs(dry_run_output: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, wildcards) of every job a `snakemake -n` output lists."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", dry_run_output):
        m = re.match(r"(?:local)?rule (\w+):", block.strip())
        if m:
            w = re.search(r"wildcards: (.*)", block)
            wildcards = dict(kv.split("=", 1) for kv in w.group(1).split(", ")) if w else {}
            jobs.append((m.group(1), wildcards))
    return jobs


LINK = re.compile(r"\]\(([^)\s]+)\)|(?:href|src)=\"([^\"]+)\"")


def dead_links(markdown: str | Path) -> list[str]:
    """The relative links and images of a Markdown file whose target file does not exist (anchors
    ignored): what a reader who clicks it would not find."""
    markdown = Path(markdown)
    dead = []
    for match in LINK.finditer(markdown.read_text()):
        target = (match.group(1) or match.group(2)).split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, a URL, a data URI
            continue
        if not (markdown.parent / target).exists():
            dead.append(target)
    return dead


def malformed_tables(markdown: str) -> list[str]:
    """The rows of the Markdown tables in `markdown` whose cell count differs from their header's
    (a row run into the next, a missing cell): each as `line N: expected, found`."""
    def cells(line: str) -> int:
        return len(re.split(r"(?<!\\)\|", line.strip())) - 2

    problems, header = [], None
    for n, line in enumerate(markdown.splitlines(), 1):
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells(line)
        elif cells(line) != header:
            problems.append(f"line {n}: {header} cells expected, {cells(line)} found")
    return problems


def lines_outside_folds(markdown: str) -> int:
    """The lines of a README a reader sees without opening a fold (<details>)."""
    depth = seen = 0
    for line in markdown.splitlines():
        depth += line.count("<details>")
        seen += depth == 0
        depth -= line.count("</details>")
    return seen


def rewrite_json(path: str | Path, edit) -> None:
    """Edit an artifact as a careful forger would: change its values (`edit(doc)`), then recompute its digest."""
    import json

    from quantstudy.artifacts import write_json

    doc = json.loads(Path(path).read_text())
    edit(doc)
    write_json(path, doc["schema"], {k: v for k, v in doc.items() if k not in ("schema", "schema_version",
                                                                              "content_sha256")})


def forge_faster(doc: dict, factor: float) -> None:
    """A timing forged with care: every graph's variant rounds divided by `factor`, and its summary and x made
    again from them as the time job makes them, so that every derived number agrees with the samples."""
    from quantstudy import timing

    for g in doc["graphs"].values():
        g["variant_ms"] = timing.summarize([t / factor for t in g["variant_ms"]["samples_ms"]])
        g.update(timing.speedup(g["baseline_ms"]["samples_ms"], g["variant_ms"]["samples_ms"]))


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: no
    port, no websocket library), to use a rendered page as a reader does: open it, click a link where
    it is drawn, read what is on the screen. One tab, `width` x `height` CSS pixels."""

    def __init__(self, executable: str, width: int = 1400, height: int = 1000, timeout: float = 60):
        import os
        import tempfile

        self.timeout, self.width, self.height = timeout, width, height
        self._profile = tempfile.TemporaryDirectory(prefix="quantstudy-chromium-")
        to_browser, self._to_browser = os.pipe()  # Chromium reads commands on its fd 3
        self._from_browser, from_browser = os.pipe()  # and writes answers and events on its fd 4

        def fds():
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-pipe",
             f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._id, self._buffer, self.events, self.session = 0, b"", [], None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        import os

        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        import shutil

        shutil.rmtree(self._profile.name, ignore_errors=True)  # Chromium may still write it as it exits

    def _message(self) -> dict:
        import json
        import os
        import select

        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], self.timeout)
            chunk = os.read(self._from_browser, 1 << 20) if ready else b""
            if not chunk:
                raise TimeoutError(f"Chromium did not answer in {self.timeout} s (exit code {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, **params):
        """One DevTools command in the tab (or on the browser, before a tab is attached); its result."""
        import json
        import os

        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._message()
            if answer.get("id") == self._id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]
            self.events.append(answer)

    def wait_for(self, event: str) -> dict:
        """The first event named `event` not yet waited for (Page.loadEventFired ...)."""
        while True:
            for i, e in enumerate(self.events):
                if e.get("method") == event:
                    return self.events.pop(i)
            self.events.append(self._message())

    def open(self, url: str) -> None:
        """Load `url` in the tab and wait until it has loaded (its images and frames too)."""
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def js(self, expression: str, frame: str | None = None):
        """The value of a JavaScript expression in the page, or in its frame `frame` (an id of frames())."""
        params = {}
        if frame is not None:
            params["contextId"] = self.call("Page.createIsolatedWorld", frameId=frame)["executionContextId"]
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True, **params)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def frames(self) -> list[dict]:
        """The page's child frames (iframes), each {"id", "url"}."""
        out, todo = [], list(self.call("Page.getFrameTree")["frameTree"].get("childFrames", []))
        while todo:
            node = todo.pop(0)
            out.append({"id": node["frame"]["id"], "url": node["frame"].get("url", "")})
            todo += node.get("childFrames", [])
        return out

    def click(self, x: float, y: float) -> None:
        """A left mouse click at (x, y) of the viewport, as a hand makes it."""
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self) -> bytes:
        """The viewport as PNG bytes."""
        import base64

        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
