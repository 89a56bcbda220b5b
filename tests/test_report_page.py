"""The report page (darts_bench/report/page.py): first differences, the side-by-side groups, and the
self-contained index.html rendered in a real headless browser (Chromium: select an example by the URL
fragment, read the rendered completions and verdicts); skipped, saying so, where no Chromium is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from darts_bench.report.page import comparison_groups, first_difference, render_page
from darts_bench.rows import Row

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser() -> str:
    for b in BROWSERS:
        if shutil.which(b):
            return shutil.which(b)
    pytest.skip(f"no headless browser installed (looked for {', '.join(BROWSERS)}; Debian: apt-get install "
                "chromium; .ci/run installs it)")


def dump_dom(page: Path, fragment: str) -> str:
    """The DOM after load (scripts run) of ``page#fragment`` in headless Chromium."""
    cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           f"--user-data-dir={page.parent / '.chromium'}", "--virtual-time-budget=5000", "--dump-dom",
           f"{page.resolve().as_uri()}#{fragment}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class Rendered(HTMLParser):
    """Text of the elements the sample browser fills: each ``pre.completion`` (by ``data-row``), the
    verdicts, the diff spans, the prompt and the first-difference note."""

    def __init__(self):
        super().__init__()
        self.stack, self.completions, self.diffs, self.verdicts, self.text = [], {}, {}, [], {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.stack.append((tag, a))
        if tag == "pre" and "completion" in (a.get("class") or ""):
            self.completions[a["data-row"]] = ""
        if "verdict" in (a.get("class") or "").split():
            self.verdicts.append("")

    def handle_endtag(self, tag):
        self.stack.pop()

    def handle_data(self, data):
        rows = [a.get("data-row") for t, a in self.stack if t == "pre" and "completion" in (a.get("class") or "")]
        if rows:
            self.completions[rows[-1]] += data
            if self.stack[-1][1].get("class") == "diff":
                self.diffs[rows[-1]] = self.diffs.get(rows[-1], "") + data
        for t, a in self.stack:
            if "verdict" in (a.get("class") or "").split():
                self.verdicts[-1] += data
            if a.get("id") in ("prompt", "first-diff", "example-id"):
                self.text[a["id"]] = self.text.get(a["id"], "") + data


def test_first_difference():
    assert first_difference(["abc", "abc", "abc"]) == None  # noqa: E711
    assert first_difference(["abc", "abd", "abc"]) == 2
    assert first_difference(["ab", "abc"]) == 2  # one ends where the other goes on
    assert first_difference(["x", "y"]) == 0 and first_difference(["only"]) is None


def test_comparison_groups_take_the_first_row_of_each_method():
    rows = [Row("base", expert="base"), Row("ties", merge="ties"),
            Row("ties+surgery", merge="ties", correction="surgery", calibration="transductive"),
            Row("ties+darts", merge="ties", correction="darts", calibration="transductive"),
            Row("ties+surgery@inductive", merge="ties", correction="surgery", calibration="inductive"),
            Row("dare", merge="dare"), Row("dare+darts", merge="dare", correction="darts")]
    assert comparison_groups(rows, ["surgery", "darts"]) == {"ties": ["ties", "ties+surgery", "ties+darts"],
                                                              "dare": ["dare", "dare+darts"]}


def _browser_data():
    ex = [{"id": "gsm8k/0", "prompt": "Question: 2+2?\nAnswer:", "target": "#### 4"},
          {"id": "gsm8k/1", "prompt": "Question: <b>3+3</b>?\nAnswer:", "target": "#### 6"}]
    # per row (ties, ties+surgery, ties+darts), per example
    resp = [["It is 4. #### 4", ""], ["It is 4. #### 4", "six </script> 6"], ["It is 5. #### 5", "It is 6"]]
    verdict = [[True, False], [True, False], [False, True]]
    cells = [[{"response": r, "extracted": None, "verdict": v} for r, v in zip(rs, vs)] for rs, vs in zip(resp, verdict)]
    return {"tasks": {"gsm8k": {"examples": ex, "groups": {"ties": {
        "rows": ["ties", "ties+surgery", "ties+darts"], "cells": cells,
        "first_diff": [first_difference([c[i]["response"] for c in cells]) for i in range(2)]}}}}}


def test_page_is_self_contained_and_renders_the_selected_example(tmp_path):
    html = render_page(name="micro", protocol_line="protocols: gsm8k lm-eval",
                       compact=pd.DataFrame([{"model": "ties", "gsm8k_em_strict": "0.5‡"}]),
                       legend=[("‡", "zero-width CI")], claims=pd.DataFrame([{"claim": "c1", "verdict": "supported"}]),
                       figures=[("plots/x.png", b"\x89PNG\r\n\x1a\nfake")], browser=_browser_data())
    # no network: nothing is fetched from elsewhere (figures inline), and the data cannot close its script
    assert not re.search(r'(src|href)="(https?:)?//', html) and 'src="data:image/png;base64,iVBORw0KGgpmYWtl"' in html
    assert "</script> 6" not in html and "\\u003c/script\\u003e 6" in html
    page = tmp_path / "index.html"
    page.write_text(html, encoding="utf-8")
    r = Rendered()
    r.feed(dump_dom(page, "task=gsm8k&merge=ties&ex=1"))
    assert r.text["example-id"] == "gsm8k/1" and r.text["prompt"] == "Question: <b>3+3</b>?\nAnswer:"
    assert r.completions == {"ties": "(empty)", "ties+surgery": "six </script> 6", "ties+darts": "It is 6"}
    assert r.verdicts == ["fail", "fail", "pass"]
    assert r.text["first-diff"] == "The completions first differ at character 0."
    r = Rendered()
    r.feed(dump_dom(page, "task=gsm8k&merge=ties&ex=0"))
    assert r.completions == {"ties": "It is 4. #### 4", "ties+surgery": "It is 4. #### 4", "ties+darts": "It is 5. #### 5"}
    assert r.diffs == {"ties": "4. #### 4", "ties+surgery": "4. #### 4", "ties+darts": "5. #### 5"}  # from char 6
    assert r.verdicts == ["pass", "pass", "fail"]


def test_first_screen_shows_every_verdict(tmp_path):
    """Headless Chromium at 1400x900: every verdict sentence of a run with a 79-row compact table and eight
    decided lines lies within the first screen (its bottom edge above 900 px), above the tables."""
    sentence = ("DARTS beats Surgery? **inconclusive** (no difference can be claimed): continuation-token KL to the "
                "expert 14.6% lower for DARTS than Surgery (95% CI 27.6% lower to 0.6% higher; a new cell: 39.2% "
                "lower to 19.9% higher), over 15 (merge, task) cells, transductive split; HKSJ p = 0.056, I² = 0.97; "
                "detectable at 80% power: 8.0% relative change.")
    compact = pd.DataFrame([{"model": f"row{i}", "gsm8k_em_strict": "0.5", "humaneval_gap_closed_gen": "0.1"}
                            for i in range(79)])
    html = render_page(name="tiny", protocol_line="protocols: gsm8k lm-eval", compact=compact, legend=[],
                       claims=pd.DataFrame([{"claim": 3, "verdict": "inconclusive"}]), figures=[],
                       browser=_browser_data(), verdicts=[sentence] * 8)
    probe = ("<script>window.addEventListener('load', () => { for (const li of document.querySelectorAll("
             "'#verdict-list li')) li.setAttribute('data-bottom', Math.ceil(li.getBoundingClientRect().bottom)); "
             "document.body.setAttribute('data-table-top', "
             "Math.floor(document.getElementById('compact').getBoundingClientRect().top)); });</script>")
    page = tmp_path / "index.html"
    page.write_text(html.replace("</body>", probe + "</body>"), encoding="utf-8")
    cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--hide-scrollbars", "--window-size=1400,900", f"--user-data-dir={tmp_path / '.chromium'}",
           "--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    bottoms = [int(b) for b in re.findall(r'data-bottom="(\d+)"', out.stdout)]
    assert len(bottoms) == 8 and max(bottoms) <= 900, bottoms
    assert int(re.search(r'data-table-top="(-?\d+)"', out.stdout).group(1)) >= max(bottoms)
    assert out.stdout.count("<strong>inconclusive</strong>") == 8
