"""A real local HTTP server that speaks the OpenAI chat-completions protocol with scripted answers.

``ScriptedOpenAI(answers)`` serves ``answers`` in order (a callable receives the request body and
returns the content); every request body is kept in ``requests`` for assertions.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = str | Callable[[dict[str, Any]], str]


class ScriptedOpenAI:
    def __init__(self, answers: list[Answer] | Callable[[dict[str, Any]], str]) -> None:
        self.answers = answers
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                if not self.path.endswith("/chat/completions"):
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = server._next(body)
                payload = json.dumps({
                    "id": f"chatcmpl-{len(server.requests)}", "object": "chat.completion", "model": body.get("model"),
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _next(self, body: dict[str, Any]) -> str:
        with self._lock:
            self.requests.append(body)
            if callable(self.answers):
                return self.answers(body)
            answer = self.answers.pop(0) if self.answers else "{}"
        return answer(body) if callable(answer) else answer

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> "ScriptedOpenAI":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
