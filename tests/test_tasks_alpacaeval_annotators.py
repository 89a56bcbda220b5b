"""A named alpaca_eval annotator (``tasks.alpacaeval.judge.annotator``) run end to end through
alpaca_eval's own machinery (``PairwiseAnnotator``, its OpenAI decoder, prompt, ranking parser and
output-order randomisation) against an OpenAI-compatible judge server on loopback: the "own judge
server" case (``OPENAI_API_BASE``). The server ranks the longer answer first.

alpaca_eval reads ``OPENAI_API_KEY`` / ``OPENAI_API_BASE`` at import time, so the evaluation runs in a
fresh interpreter with them set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA_DIR as DATA

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.skipif(not (DATA / "alpaca_eval/gpt4_1106_preview_model_outputs.json").is_file(),
                                 reason="shared AlpacaEval data not available"), pytest.mark.subprocess]

SCRIPT = r'''
import json, os, re, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

calls = []

class Judge(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        calls.append(self.path)
        text = "".join(m["content"] for m in body["messages"])
        a = re.search(r'"model": "model_1",\s*"answer": """(.*?)"""', text, re.S).group(1)
        b = re.search(r'"model": "model_2",\s*"answer": """(.*?)"""', text, re.S).group(1)
        r1, r2 = (1, 2) if len(a) >= len(b) else (2, 1)
        content = f"[{{'model': 'model_1', 'rank': {r1}}}, {{'model': 'model_2', 'rank': {r2}}}]"
        data = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

srv = HTTPServer(("127.0.0.1", 0), Judge)
threading.Thread(target=srv.serve_forever, daemon=True).start()
os.environ["OPENAI_API_KEY"] = "sk-local-test"
os.environ["OPENAI_API_BASE"] = f"http://127.0.0.1:{srv.server_port}/v1"

from darts_bench.api import EvalContext, _import_task_folder
from darts_bench.config import AlpacaEvalConfig, JudgeConfig
_import_task_folder(Path(sys.argv[1]) / "tasks" / "alpacaeval")
from darts_bench_tasks.alpacaeval import AlpacaEvalTask

data = Path(sys.argv[2])

class Fmt:
    def format_chat(self, m):
        return f"<user>{m}<assistant>"

task = AlpacaEvalTask()
ex = task.examples(data, Fmt(), limit=3)

class Model(Fmt):
    name = "stub"
    def generate(self, prompts, **kw):
        # longer than the reference on #0 only
        return [[ex[0].reference + " And one more sentence."]] + [["Short."]] * (len(prompts) - 1)
    def score(self, contexts, continuations):
        from darts_bench.api import ScoreContinuation
        return [ScoreContinuation(nll=0.1 * len(c), n_tokens=len(c), greedy=False) for c in continuations]

cfg = AlpacaEvalConfig(limit=3, judge=JudgeConfig(annotator="alpaca_eval_gpt4"))
res = task.evaluate(Model(), ex, EvalContext(config=cfg, data_dir=data, seed=0, work_dir=Path("."),
                                             get_model=None))
print("RESULT " + json.dumps({"metrics": res.metrics, "meta": {k: res.meta[k] for k in
      ("judge", "annotator", "judge_mode", "judge_name", "judge_both_orders", "n_unparsed")}, "calls": calls,
      "verdicts": [s["verdict_model_second"] for s in res.samples]}))
'''


def test_named_annotator_through_alpaca_eval_against_local_judge_server(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1"
    proc = subprocess.run([sys.executable, str(script), str(REPO), str(DATA)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    assert out["verdicts"] == [2.0, 1.0, 1.0]  # the model's answer is longer on #0 only
    assert out["metrics"]["alpacaeval_win_rate"] == pytest.approx(100 / 3)
    assert out["metrics"]["alpacaeval_unparsed"] == 0 and out["metrics"]["alpacaeval_win_rate_flag"] is None
    assert out["meta"]["judge"] == "alpaca_eval:alpaca_eval_gpt4" and out["meta"]["annotator"] == "alpaca_eval_gpt4"
    assert out["meta"]["judge_name"] == "gpt-4" and out["meta"]["judge_both_orders"] is False
    assert out["meta"]["judge_mode"] == "openai_completions"
    assert out["calls"] == ["/v1/chat/completions"] * 3
