"""The live page at `/`, driven in a real headless browser (Debian's chromium through playwright).

The stack is the end-to-end tests' shared `inflight dev` (`make run`'s model, paced at 20 ms a step). The
browser loads the page, sends a prompt as three requests (the copies join the first's batch a few tokens
apart), and the test checks what a person would see: tokens arriving one piece at a time with TTFT
and tokens/s, the batch view filling with prefill and decode cells whose step numbers move on, the
page's own rows marked, and no console errors. `make test` installs chromium (apt-get, as root) when
it is missing; without it this skips.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from tests.e2e.conftest import DevStack

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        CHROMIUM is None or sync_playwright is None,
        reason="LIVE PAGE NOT TESTED: no chromium on PATH (make test installs Debian's chromium as root) "
        "or playwright missing (dev extra)",
    ),
]


@pytest.fixture(scope="module")
def base_url(dev_stack: DevStack) -> str:
    return dev_stack.url


# Records, in the page, every change of the streamed answer and of the batch view's newest step.
_WATCH = """() => {
  window.__pieces = [];
  window.__steps = [];
  new MutationObserver(() => {
    const answers = document.querySelectorAll('#transcript .msg.assistant');
    const last = answers[answers.length - 1];
    if (last) window.__pieces.push(last.textContent.length);
  }).observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true});
  window.__mine = new Set();  // rows marked as this page's requests
  window.__left = new Set();  // rows marked as having left the batch
  window.__prefill = false;  // a prefill chunk was drawn
  window.__shared = 0;  // the most requests seen in one step
  window.__joinedRunning = false;  // a request joined a step in which another one was decoding
  new MutationObserver(() => {
    const head = document.querySelectorAll('#batch tr:first-child th');
    if (head.length > 1) window.__steps.push(head[head.length - 1].textContent);
    const rows = [...document.querySelectorAll('#batch tr')].slice(1);
    if (document.querySelector('#batch td.prefill')) window.__prefill = true;
    for (const r of rows) {
      if (r.classList.contains('mine')) window.__mine.add(r.dataset.rid);
      if (r.querySelector('td.leave')) window.__left.add(r.dataset.rid);
    }
    for (let col = 1; col < head.length; col++) {
      const cells = rows.map((r) => r.children[col]).filter((c) => c && c.className);
      window.__shared = Math.max(window.__shared, cells.length);
      if (cells.some((c) => c.classList.contains('join'))
          && cells.some((c) => c.classList.contains('decode') && !c.classList.contains('join'))) {
        window.__joinedRunning = true;
      }
    }
  }).observe(document.getElementById('batch'), {subtree: true, childList: true});
}"""


def test_live_page_streams_a_prompt_and_draws_the_batch(base_url: str) -> None:
    assert sync_playwright is not None and CHROMIUM is not None
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
            page.goto(base_url + "/")
            assert page.title() == "inflight"
            page.wait_for_function("document.getElementById('model').textContent === 'smollm2-135m-instruct'")
            page.wait_for_function("document.getElementById('feed').className === 'on'")
            page.evaluate(_WATCH)

            page.fill("#prompt", "Once upon a time")
            # The copies start at the answer's 4th and 8th piece (live.js STAGGER): 24 tokens leave the
            # three of them many shared steps, and every token is a step of SmolLM2 on this host's CPU.
            page.fill("#max_tokens", "24")
            page.fill("#parallel", "3")
            page.click("#send")
            # Generous: the paced steps bound the run from below, the host's speed from above.
            page.wait_for_function("document.getElementById('send').disabled === false", timeout=240_000)
            # The idle heartbeat after the burst marks the last ones as left and the engine as idle.
            page.wait_for_function("document.getElementById('running').textContent === '0'", timeout=10_000)
            page.wait_for_function("window.__left.size >= 3", timeout=10_000)
            state: dict[str, Any] = page.evaluate(
                """() => ({
                  pieces: window.__pieces, steps: window.__steps,
                  shared: window.__shared, joinedRunning: window.__joinedRunning,
                  answer: document.querySelector('#transcript .msg.assistant').textContent,
                  ttft: document.getElementById('ttft').textContent,
                  tps: document.getElementById('tps').textContent,
                  ntok: document.getElementById('ntok').textContent,
                  prefill: window.__prefill,
                  decode: document.querySelectorAll('#batch td.decode').length,
                  mine: window.__mine.size, left: window.__left.size,
                  running: document.getElementById('running').textContent,
                })"""
            )
            if os.environ.get("INFLIGHT_LIVE_SCREENSHOT"):  # to look at it: a PNG path
                page.screenshot(path=os.environ["INFLIGHT_LIVE_SCREENSHOT"])
        finally:
            browser.close()

    # Streamed: the answer grew piece by piece, and the page measured it.
    assert state["answer"] and len(set(state["pieces"])) >= 3, state
    assert float(state["ttft"]) > 0 and float(state["tps"]) > 0 and int(state["ntok"]) >= 2, state
    # The batch view moved: newer steps arrived while the requests ran (published every 0.25 s, so
    # the view moves in jumps of several steps), with their cells.
    steps = [int(s) for s in state["steps"]]
    assert len(set(steps)) >= 2 and steps[-1] > steps[0], steps
    # Continuous batching, seen: the copies joined while the first request was decoding, and shared steps.
    assert state["joinedRunning"] and state["shared"] >= 2, state
    assert state["prefill"] and state["decode"] >= 3, state
    assert state["mine"] == 3 and state["left"] >= 3, state  # the page's own three requests came and went
    assert state["running"] == "0", state  # idle again after the burst
    assert not problems, problems
