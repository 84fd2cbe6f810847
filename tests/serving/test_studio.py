"""The studio page (GET /studio), driven in headless Chromium through Playwright: on the
demo, one frame per forward and the answer; a threshold that takes fewer forwards; a bad
option shows the server's own message; two settings side by side; the replay slider; the
unmask-order picture as PNG and SVG; the page's policy (its own files only, CSP, same
origin). Then LLaDA2.1's edits, LLaDA2.2's inserts and deletes, and DiffusionGemma's uniform canvas with an image. And the
same picture from the CLI (--trace-png) and from a protocol response.

.ci/run installs Debian's chromium; Playwright's Python package drives it
(`executable_path`), so no browser is downloaded. STUDIO_PICTURES=DIR keeps the run's
screenshots and exported picture there (docs/images: the docs' pictures come from this run, and
tests/evaluation/test_evaluation.py's plot)."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from server_runs import get_json, post_json, running_server

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.output import unmask_order

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
]
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "the studio tests need Debian's chromium (.ci/run installs it)"
    # Playwright's node and Chromium without the tests' LD_PRELOAD of OpenBLAS (node's
    # threads fail to start under it): the driver takes the environment at its start
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        manager = sync_playwright().start()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        chromium = manager.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()
    finally:
        manager.stop()


def serve(path: Path, *flags: str):
    return running_server(["--model", str(path), "--port", "0", "--log-level", "WARNING", *flags])


@pytest.fixture(scope="module")
def demo():
    with serve(DEMO_MODEL_PATH) as (httpd, _):
        yield f"http://127.0.0.1:{httpd.server_address[1]}"


class Studio:
    """One page of the studio, and what it saw."""

    def __init__(self, browser, url: str):
        self.url, self.requests, self.problems = url, [], []
        self.page = browser.new_page(viewport={"width": 1200, "height": 900}, accept_downloads=True)
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("pageerror", lambda e: self.problems.append(str(e)))
        self.page.on("console", lambda m: self.problems.append(m.text) if m.type == "error" else None)
        self.page.goto(url + "/studio")
        self.page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
        self.runs = 0

    def set(self, pane: str, **options) -> None:
        for name, value in options.items():
            field = self.page.locator(f"#pane-{pane} .settings [name={name}]")
            if field.evaluate("e => e.tagName") == "SELECT":
                field.select_option(str(value))
            else:
                field.fill(str(value))

    def ask(self, text: str, image: Path | None = None) -> None:
        if image is not None:
            self.page.set_input_files("#image", str(image))
        self.page.fill("#prompt", text)
        self.page.click("#run")
        self.runs += 1
        self.page.wait_for_selector(f"body[data-runs='{self.runs}']", timeout=WAIT_MS)

    def text(self, selector: str) -> str:
        return self.page.inner_text(selector)

    def frames(self, pane: str = "a") -> list:
        return self.page.evaluate(f"window.studio.panes.{pane}.frames")

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def studio(browser, demo):
    page = Studio(browser, demo)
    yield page
    page.close()
    assert not page.problems, page.problems  # no script error, no refused resource


def keep_screenshot(page, name: str) -> None:
    """With STUDIO_PICTURES=DIR, the page as it is now (the docs' pictures are made by these tests)."""
    if os.environ.get("STUDIO_PICTURES"):
        for box in page.locator("details.settings-box").all():
            box.evaluate("e => e.open = false")  # (the canvases, not the controls)
        out = Path(os.environ["STUDIO_PICTURES"])
        out.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out / name))


def picture(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_demo_draws_one_frame_per_forward_and_the_answer(studio):
    studio.ask("357+468=")
    assert studio.text("#pane-a .answer") == "825"
    frames = studio.frames()
    forwards = int(studio.text("#pane-a .forwards"))
    assert [f["forwards"] for f in frames] == list(range(1, forwards + 1))  # one frame per forward
    assert int(studio.text("#pane-a .frames")) == forwards
    first, last = frames[0], frames[-1]
    assert "m" in first["states"] and last["states"][:6] == "cccccc"
    cells = studio.page.locator("#pane-a .canvas .cell").all_inner_texts()
    assert "".join(cells[:5]).replace("∅", "") == "825"
    assert float(studio.text("#pane-a .tpf")) == pytest.approx(last["committed"] / forwards, abs=0.01)
    assert studio.text("#history").split() == ["357+468=", "825"]
    assert all(url.startswith(studio.url) for url in studio.requests)  # its own files and routes only


def test_hovering_a_cell_shows_the_models_five_likeliest_tokens_there(studio):
    """Each frame carries, per position its forward predicted, the 5 likeliest tokens and their
    probabilities (the request's `proposals`); a cell's hover text lists them for the frame shown,
    most likely first, their probabilities summing to at most 1. A server refuses proposals
    without drafts and beyond its bound."""
    studio.ask("357+468=")
    frames = studio.frames()
    assert all(f.get("proposals") for f in frames)
    position, top = frames[0]["proposals"][0]
    assert len(top) == 5 and sum(p for _, p in top) <= 1 + 1e-6 and top == sorted(top, key=lambda t: -t[1])
    studio.page.locator("#pane-a .replay").fill("0")
    cells = studio.page.locator("#pane-a .canvas .cell")
    hover = cells.nth(position).get_attribute("title")
    lines = [line for line in hover.splitlines() if line.startswith("  ")]
    assert len(lines) == 5 and "likeliest here at forward 1" in hover
    shares = [float(line.rsplit(" ", 1)[1].rstrip("%")) for line in lines]
    assert shares == sorted(shares, reverse=True) and sum(shares) <= 100.05
    cells.nth(position).click()  # (a tap: a touch screen shows no hover text)
    assert studio.page.locator("#pane-a .detail").inner_text().strip() == hover.strip()
    port = int(studio.url.rsplit(":", 1)[1])
    ask = {"messages": [{"role": "user", "content": "1+1="}]}
    assert post_json(port, "/v1/chat/completions", {**ask, "proposals": 5})[0] == 400  # (no drafts)
    status, body = post_json(port, "/v1/chat/completions", {**ask, "stream": True, "drafts": True, "proposals": 99})
    assert status == 400 and body["error"]["param"] == "proposals"


def test_a_threshold_takes_fewer_forwards(studio):
    studio.ask("357+468=")
    one_per_forward = int(studio.text("#pane-a .forwards"))
    studio.set("a", threshold=0.5)
    studio.ask("357+468=")
    assert studio.text("#pane-a .answer") == "825"
    assert int(studio.text("#pane-a .forwards")) < one_per_forward


def test_a_bad_option_shows_the_servers_message(studio):
    status, answer = post_json(
        int(studio.url.rsplit(":", 1)[1]),
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "1+1="}], "threshold": 2},
    )
    assert status == 400
    studio.set("a", threshold=2)
    studio.ask("1+1=")
    assert studio.text("#pane-a .error") == answer["error"]["message"]
    assert studio.text("#pane-a .answer") == "" and studio.text("#history") == ""
    assert studio.problems == ["Failed to load resource: the server responded with a status of 400 (Bad Request)"]
    studio.problems.clear()  # (the browser's own line about the refused request: expected here)


def test_an_error_clears_the_panes_old_results(studio):
    studio.ask("357+468=")
    assert studio.text("#pane-a .answer") == "825" and studio.frames()
    studio.set("a", threshold=2)
    studio.ask("1+1=")  # refused: nothing of the previous prompt may stay under the error
    assert studio.text("#pane-a .error")
    assert studio.text("#pane-a .answer") == "" and studio.frames() == []
    assert studio.page.locator("#pane-a .canvas .cell").count() == 0
    assert studio.text("#pane-a .forwards") == "0" and studio.text("#pane-a .tpf") == "–"
    assert studio.page.locator("#pane-a .replay").is_disabled() and studio.page.locator("#pane-a .png").is_disabled()
    assert studio.page.evaluate("document.querySelector('#pane-a .order').width") == 10
    studio.problems.clear()  # (the browser's own line about the refused request)


def test_the_defaults_shown_are_the_checkpoints(studio):
    """The placeholders say what the served model decodes with when a field is left empty:
    the demo's generation_config.json (max_tokens 32, block_length 8), not the schema's."""
    config = json.loads((DEMO_MODEL_PATH / "generation_config.json").read_text())
    field = lambda name: studio.page.locator(f"#pane-a .settings [name={name}]")  # noqa: E731
    assert field("max_tokens").get_attribute("placeholder") == str(config["max_new_tokens"])
    assert field("block_length").get_attribute("placeholder") == str(config["block_length"])
    assert field("steps").get_attribute("placeholder") == str(config["steps"])
    assert field("strategy").locator("option").first.inner_text() == f"(default: {config['strategy']})"
    studio.ask("357+468=")  # and that is what a run with the fields empty does
    frames = studio.frames()
    assert len(frames[-1]["tokens"]) == config["max_new_tokens"] and frames[0]["block"] == [0, config["block_length"]]


def test_stop_cancels_a_long_request(studio, caplog):
    """Stop ends the request (the server cancels its decode: nothing runs after it, and it logs
    the cancel); the live tokens/forward counts a block's committed positions before the block ends."""
    caplog.set_level(logging.INFO)
    port = int(studio.url.rsplit(":", 1)[1])
    studio.set("a", max_tokens=110, block_length=110, steps=110)  # one block of the demo's whole context: seconds
    studio.page.fill("#prompt", "357+468=")
    studio.page.click("#run")
    studio.runs += 1
    for _ in range(1200):  # (wait_for_function evaluates a string: the page's CSP refuses it)
        if studio.page.evaluate("window.studio.panes.a.frames.length") >= 5:
            break
        time.sleep(0.1)
    shown, last = studio.page.evaluate(
        "() => [document.querySelector('#pane-a .tpf').textContent, window.studio.panes.a.frames.at(-1)]"
    )
    studio.page.evaluate("document.querySelector('#stop').click()")  # (at once: the canvas grows under it)
    studio.page.wait_for_selector(f"body[data-runs='{studio.runs}']", timeout=WAIT_MS)
    assert studio.text("#pane-a .error") == "stopped: the request was cancelled"
    decoded = last["states"][: last["block"][1]].count("c")  # (the block's committed positions, live)
    if shown != "–":  # (no frame drawn yet at that instant)
        assert float(shown) == pytest.approx(max(decoded, last["committed"]) / last["forwards"], abs=0.01)
    frames = studio.frames()
    assert len(frames) < 110 and studio.text("#history") == ""
    assert studio.page.locator("#stop").is_disabled() and not studio.page.locator("#run").is_disabled()
    for _ in range(300):  # the server's decode ends at its next forward
        if get_json(port, "/v1/stats")["running"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the decode still runs 30 s after Stop")
    assert any("a decode stopped:" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    studio.problems.clear()  # (the browser's own line about the aborted fetch, if any)


def test_example_prompts_come_from_the_server(studio):
    from mlx_lm_diffusion.serving.studio import DEMO_EXAMPLES

    buttons = studio.page.locator("#examples button")
    assert buttons.all_inner_texts() == list(DEMO_EXAMPLES)  # (the demo's own problems on the demo)
    buttons.nth(1).click()
    assert studio.page.input_value("#prompt") == DEMO_EXAMPLES[1]


def test_end_token_runs_are_one_cell_and_colours_are_viridis(studio):
    studio.ask("357+468=")
    frames = studio.frames()
    last = frames[-1]
    runs = studio.page.locator("#pane-a .canvas .cell.run")
    assert runs.count() >= 1 and "×" in runs.first.inner_text()
    counts = [int(text.rsplit("×", 1)[1]) for text in runs.all_inner_texts()]
    cells = studio.page.locator("#pane-a .canvas .cell").count()
    shown = max(i for i, c in enumerate(last["states"]) if c != "m") + 1
    assert cells - len(counts) + sum(counts) == max(shown, last["block"][1])  # (every position, once)
    styles = studio.page.locator("#pane-a .canvas .cell.c").evaluate_all("cells => cells.map(c => c.style.background)")
    assert styles and all(s.startswith("rgb(") for s in styles)  # (the viridis ramp, no rainbow of hues)
    assert studio.page.locator("#pane-a .legend .ramp").is_visible()


def test_a_narrow_screen_stacks_the_panes(browser, demo):
    """At 420 px pane A's replay slider ran over pane B: the panes now stack, and no control
    of one lies over the other's."""
    page = Studio(browser, demo)
    try:
        page.page.set_viewport_size({"width": 420, "height": 900})
        page.page.select_option("#compare", "2")
        page.ask("357+468=")
        a, b = (page.page.locator(f"#pane-{p}").bounding_box() for p in "ab")
        assert a["y"] + a["height"] <= b["y"]  # (one above the other)
        for control in page.page.locator("#pane-a input, #pane-a select, #pane-a button").all():
            box = control.bounding_box()
            if box is not None:
                assert box["x"] + box["width"] <= a["x"] + a["width"] + 1 and box["y"] + box["height"] <= b["y"]
        assert not page.problems, page.problems
    finally:
        page.close()


def test_the_page_follows_a_dark_system_theme(browser, demo):
    page = Studio(browser, demo)
    try:
        background = "getComputedStyle(document.body).backgroundColor"
        assert page.page.evaluate(background) in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)")
        page.page.emulate_media(color_scheme="dark")
        r, g, b = (int(v) for v in page.page.evaluate(background)[4:-1].split(","))
        assert max(r, g, b) < 64  # (dark)
        text = page.page.evaluate("getComputedStyle(document.body).color")
        assert min(int(v) for v in text[4:-1].split(",")) > 180  # (light text on it)
        if os.environ.get("STUDIO_PICTURES"):
            page.ask("357+468=")
            keep_screenshot(page.page, "studio-dark.png")
    finally:
        page.close()


def test_compare_runs_two_settings_side_by_side(studio):
    studio.page.select_option("#compare", "2")
    studio.set("b", threshold=0.9, cache="dual")
    studio.ask("1234+4321=")
    answers = [studio.text(f"#pane-{p} .answer") for p in "ab"]
    forwards = [int(studio.text(f"#pane-{p} .forwards")) for p in "ab"]
    assert answers == ["5555", "5555"]
    assert forwards[1] < forwards[0]
    assert [len(studio.frames(p)) for p in "ab"] == forwards
    assert studio.page.locator("#pane-b").is_visible()
    keep_screenshot(studio.page, "studio.png")


def test_compare_runs_four_settings_and_their_controls_never_overlap(browser, demo):
    """Four settings on one prompt: each pane its own answer, forwards, tokens/forward and time;
    at 1280 px and at 420 px no control of one pane lies over another pane."""
    page = Studio(browser, demo)
    try:
        page.page.select_option("#compare", "4")
        assert all(page.page.locator(f"#pane-{p}").is_visible() for p in "abcd")
        for p, threshold in zip("bcd", (0.5, 0.7, 0.9)):
            page.set(p, threshold=threshold)
        page.ask("1234+4321=")
        for p in "abcd":
            assert page.text(f"#pane-{p} .answer") == "5555"
            assert int(page.text(f"#pane-{p} .forwards")) == len(page.frames(p)) > 0
            assert page.text(f"#pane-{p} .tpf") != "–" and page.text(f"#pane-{p} .time").endswith(" s")
        for width in (1280, 420):
            page.page.set_viewport_size({"width": width, "height": 900})
            boxes = {p: page.page.locator(f"#pane-{p}").bounding_box() for p in "abcd"}
            for p in "abcd":
                for control in page.page.locator(f"#pane-{p} input, #pane-{p} select, #pane-{p} button").all():
                    box = control.bounding_box()
                    if box is None:
                        continue
                    for q, other in boxes.items():
                        if q != p:
                            assert not _overlap(box, other), (width, p, q)
        page.page.set_viewport_size({"width": 1280, "height": 900})
        keep_screenshot(page.page, "studio-compare.png")
        page.page.select_option("#compare", "1")
        assert not page.page.locator("#pane-b").is_visible()
        assert not page.problems, page.problems
    finally:
        page.close()


def _overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["width"] - 1
        and b["x"] < a["x"] + a["width"] - 1
        and a["y"] < b["y"] + b["height"] - 1
        and b["y"] < a["y"] + a["height"] - 1
    )


def test_the_replay_slider_redraws_the_canvas(studio):
    studio.ask("357+468=")
    last = studio.page.locator("#pane-a .canvas").inner_text()
    slider = studio.page.locator("#pane-a .replay")
    slider.fill("0")
    assert studio.text("#pane-a .replay-at").startswith("1 /")
    first = studio.page.locator("#pane-a .canvas .cell.m").count()
    assert first > 0 and studio.page.locator("#pane-a .canvas").inner_text() != last
    slider.fill(str(len(studio.frames()) - 1))
    assert studio.page.locator("#pane-a .canvas .cell.m").count() < first


def test_the_downloads_are_the_one_renderers_pictures(studio, tmp_path):
    """PNG and SVG: the unmask order drawn by the server with the CLI's renderer (axes, a colour
    bar, a title naming the model and the pane's settings), within 2000 px; GIF: the decode as an
    animation with one frame per forward, which Pillow decodes. Bad render requests are a 400."""
    studio.set("a", threshold=0.5)
    studio.ask("357+468=")
    frames = studio.frames()
    with studio.page.expect_download() as download:
        studio.page.click("#pane-a .png")
    png = picture(Path(download.value.path()).read_bytes())
    assert max(png.shape[:2]) <= 2000 and len(np.unique(png.reshape(-1, 3), axis=0)) > 10
    grey = png.mean(axis=2)
    assert (grey[:, : png.shape[1] // 12] < 128).any() and (grey[-png.shape[0] // 8 :] < 128).any()  # (axes text)
    with studio.page.expect_download() as download:
        studio.page.click("#pane-a .svg")
    svg = Path(download.value.path()).read_text()
    assert "<svg" in svg and "threshold=0.5" in svg and "generated position" in svg
    with studio.page.expect_download() as download:
        studio.page.click("#pane-a .gif")
    animated = Image.open(download.value.path())
    assert animated.format == "GIF" and animated.n_frames == len(frames) == int(studio.text("#pane-a .forwards"))
    port = int(studio.url.rsplit(":", 1)[1])
    assert post_json(port, "/v1/studio/render", {"format": "bmp", "frames": frames})[0] == 400
    status, body = post_json(port, "/v1/studio/render", {"format": "png", "frames": [{"states": 3}]})
    assert status == 400 and body["error"]["param"] == "frames"
    if os.environ.get("STUDIO_PICTURES"):
        out = Path(os.environ["STUDIO_PICTURES"])
        out.mkdir(parents=True, exist_ok=True)
        Image.fromarray(png).save(out / "unmask-order.png")


def test_the_page_is_served_under_a_strict_policy(demo, browser):
    import http.client

    host, port = demo.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/studio")
    response = conn.getresponse()
    response.read()
    csp = response.getheader("Content-Security-Policy")
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    conn.request("GET", "/studio", headers={"Host": "evil.example.com"})
    refused = conn.getresponse()
    refused.read()
    assert refused.status == 403  # the server's Host policy holds for the page too
    # another origin's page cannot drive the server (no --allowed-origins)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "1+1="}]}),
        {"Content-Type": "application/json", "Origin": "http://evil.example.com"},
    )
    assert conn.getresponse().status == 403
    conn.close()
    # the controls are the server's option listing, nothing else
    listing = json.loads(subprocess_get(demo + "/v1/options"))
    page = Studio(browser, demo)
    names = page.page.locator("#pane-a .settings [name]").evaluate_all("es => es.map(e => e.name)")
    page.close()
    assert names == [o["name"] for o in listing["data"]]
    assert "cache" in names and "threshold" in names and "temperature" in names


def subprocess_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def test_llada2_1_edits_show_as_edits(browser, tmp_path):
    from mlx_lm_diffusion.testing.block_checkpoints import write_llada2

    with serve(write_llada2(tmp_path / "llada2")) as (httpd, _):
        page = Studio(browser, f"http://127.0.0.1:{httpd.server_address[1]}")
        page.set("a", max_tokens=16, block_length=8, threshold=0.5, editing_threshold=0.5, temperature=0)
        page.ask("hello")
        frames = page.frames()
        edited = [
            i
            for k in range(1, len(frames))
            for i, (a, b) in enumerate(zip(frames[k - 1]["tokens"], frames[k]["tokens"]))
            if a is not None and a != b
        ]
        assert edited, "the tiny LLaDA2.1 checkpoint edits under editing_threshold 0.5"
        assert page.page.locator("#pane-a .canvas .cell.edited").count() > 0
        keep_screenshot(page.page, "studio-edit.png")
        assert not page.problems
        page.close()


def test_llada2_2_inserts_and_deletes_show_on_the_canvas(browser, tmp_path):
    """LLaDA2.2's SPLITs (an inserted mask, outlined) and DELETEs (a -N chip) on the frames
    where they happened, found with the replay slider."""
    from mlx_lm_diffusion.testing.block_checkpoints import write_llada2_2

    with serve(write_llada2_2(tmp_path / "llada2_2")) as (httpd, _):
        page = Studio(browser, f"http://127.0.0.1:{httpd.server_address[1]}")
        page.set("a", max_tokens=16, temperature=0)
        page.ask("hello")
        frames = page.frames()
        inserted = [k for k, f in enumerate(frames) if f.get("inserted")]
        deleted = [k for k, f in enumerate(frames) if f.get("deleted")]
        assert inserted and deleted, "the tiny LLaDA2.2 checkpoint proposes SPLIT and DELETE"
        slider = page.page.locator("#pane-a .replay")
        slider.fill(str(inserted[0]))
        assert page.page.locator("#pane-a .canvas .cell.inserted").count() == len(frames[inserted[0]]["inserted"])
        slider.fill(str(deleted[0]))
        assert page.page.locator("#pane-a .canvas .cell.deleted").inner_text() == f"−{frames[deleted[0]]['deleted']}"
        assert not page.problems
        page.close()


def test_idlm_rounds_show_their_drafts_as_drafts(browser, tmp_path):
    """I-DLM (a checkpoint whose drafts are always right): each round's next drafts are dashed
    draft cells past the committed ones, then committed by the next round; the answer is the
    committed tokens."""
    from mlx_lm_diffusion.testing.block_checkpoints import write_idlm

    with serve(write_idlm(tmp_path / "idlm", forced=100)) as (httpd, _):
        page = Studio(browser, f"http://127.0.0.1:{httpd.server_address[1]}")
        page.set("a", max_tokens=12, temperature=0)
        page.ask("hello")
        frames = page.frames()
        with_drafts = [k for k, f in enumerate(frames) if "d" in f["states"]]
        assert with_drafts and len(frames) < 12  # (rounds of several tokens)
        first = frames[with_drafts[0]]
        assert first["states"].rstrip("m").endswith("d") and "c" in first["states"]
        page.page.locator("#pane-a .replay").fill(str(with_drafts[0]))
        assert page.page.locator("#pane-a .canvas .cell.d").count() == first["states"].count("d")
        assert frames[-1]["states"].count("d") == 0
        assert not page.problems
        page.close()


def test_diffusion_gemma_draws_its_uniform_canvas_with_an_image(browser, tmp_path):
    from mlx_lm_diffusion.testing.gemma_vision_checkpoints import make_image, write_gemma_with_vision

    image = tmp_path / "picture.png"
    make_image().save(image)
    with serve(write_gemma_with_vision(tmp_path / "gemma")) as (httpd, _):
        page = Studio(browser, f"http://127.0.0.1:{httpd.server_address[1]}")
        assert page.page.locator("#image-label").is_visible()  # a vision tower: images attach
        page.set("a", max_tokens=8, temperature=0)
        page.ask("describe", image=image)
        frames = page.frames()
        assert page.text("#pane-a .error") == "" and frames
        assert set("".join(f["states"] for f in frames)) == {"d"}  # no mask token: argmax drafts
        assert int(page.text("#pane-a .forwards")) == len(frames) > 1
        renoised = [
            i
            for k in range(1, len(frames))
            for i, (a, b) in enumerate(zip(frames[k - 1]["tokens"], frames[k]["tokens"]))
            if a != b
        ]
        assert renoised, "a random uniform canvas changes its drafts between forwards"
        page.page.locator("#pane-a .replay").fill(str(min(renoised_frame(frames), len(frames) - 1)))
        assert page.page.locator("#pane-a .canvas .cell.edited").count() > 0
        # the draws the rule kept at a forward (the Step's accepted set), drawn apart from the re-noised
        kept = [k for k, f in enumerate(frames) if f.get("accepted")]
        assert kept and all(0 <= i < len(frames[k]["states"]) for k in kept for i in frames[k]["accepted"])
        page.page.locator("#pane-a .replay").fill(str(kept[0]))
        shown = page.page.locator("#pane-a .canvas .cell.accepted")
        assert shown.count() == len([i for i in frames[kept[0]]["accepted"] if i < len(frames[kept[0]]["tokens"])])
        assert "accepted" in shown.first.get_attribute("title")
        keep_screenshot(page.page, "studio-gemma.png")
        assert not page.problems
        page.close()


def renoised_frame(frames: list) -> int:
    """The first frame whose drafts differ from the frame before."""
    return next(k for k in range(1, len(frames)) if frames[k]["tokens"] != frames[k - 1]["tokens"])


# -- the same picture outside the page


def test_trace_png_from_the_generate_cli(tmp_path):
    out = tmp_path / "order.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm_diffusion.generate",
            "--prompt",
            "357+468=",
            "--max-tokens",
            "8",
            "--trace-png",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "825" in done.stdout
    pixels = picture(out.read_bytes())
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm_diffusion.generate",
            "--prompt",
            "1+1=",
            "--trace-png",
            str(tmp_path / "order.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --trace-png")


def test_the_picture_of_a_protocol_response(tmp_path):
    from protocol_requests import greedy_linear

    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.api import protocol

    model, tokenizer = mld.load(str(DEMO_MODEL_PATH))
    prompt = tokenizer.encode("357+468=")
    response = protocol.run_request(model, tokenizer, greedy_linear(prompt))
    order = unmask_order.from_protocol(response)
    committed = {i - len(prompt) for step in response["per_step_unmasked"] for i in step["token_indices"]}
    assert len(order.forward) == 8 and set(np.flatnonzero(order.forward).tolist()) == committed
    first = response["per_step_unmasked"][0]
    assert all(order.forward[i - len(prompt)] == first["step"] + 1 for i in first["token_indices"])
    saved = tmp_path / "response.json"
    saved.write_text(json.dumps(response))
    done = subprocess.run(
        [sys.executable, "-m", "mlx_lm_diffusion.output.unmask_order", str(saved), str(tmp_path / "order.svg")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert ET.parse(tmp_path / "order.svg").getroot().tag.endswith("svg")
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm_diffusion.output.unmask_order",
            str(tmp_path / "nope.json"),
            str(tmp_path / "x.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
