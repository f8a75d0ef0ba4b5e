"""Generated nginx configurations: the fixed-cost backend and the reference reverse proxy.

Each nginx runs in the foreground (``daemon off``) under a subprocess, with its pid file, logs and
temp paths inside a private directory and one worker listening on 127.0.0.1 only.
"""

from __future__ import annotations

from pathlib import Path

from loadtest.bench import payloads

_MAIN_TEMPLATE = """\
daemon off;
master_process on;
worker_processes 1;
pid {run_dir}/nginx.pid;
error_log {run_dir}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    client_body_temp_path {run_dir}/client_body;
    proxy_temp_path {run_dir}/proxy;
    fastcgi_temp_path {run_dir}/fastcgi;
    uwsgi_temp_path {run_dir}/uwsgi;
    scgi_temp_path {run_dir}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
{servers}
}}
"""

_BACKEND_SERVER = """\
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        default_type application/json;
        location = /health {{ return 200 '{{"status":"ok"}}'; }}
        location = /v1/models {{ return 200 '{models}'; }}
        # sglang's worker-info routes, old and new names: sglang-router reads them at registration.
        location = /server_info {{ return 200 '{server_info}'; }}
        location = /get_server_info {{ return 200 '{server_info}'; }}
        location = /model_info {{ return 200 '{model_info}'; }}
        location = /get_model_info {{ return 200 '{model_info}'; }}
        location = {chat_path} {{
            default_type {chat_type};
            return 200 '{chat_body}';
        }}
        location / {{ return 404 '{{"error":{{"message":"not found"}}}}'; }}
    }}
"""

_PROXY_SERVER = """\
    upstream bench_backend {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://bench_backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
"""


def nginx_string(raw: bytes) -> str:
    """Quote bytes as the inside of a single-quoted nginx string (``return 200 '...'``)."""
    text = raw.decode()
    if "$" in text:
        raise ValueError("a body served by nginx `return` must not contain '$' (nginx would expand it)")
    return text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")


def backend_config(run_dir: Path, json_port: int, stream_port: int) -> str:
    """One nginx serving fixed OpenAI answers: JSON on ``json_port``, SSE on ``stream_port``.

    Two ports because nginx cannot branch on the request body's ``stream`` flag without a module.
    """
    models = nginx_string(payloads.models_body())
    servers = [
        _BACKEND_SERVER.format(
            port=port,
            models=models,
            server_info=nginx_string(payloads.server_info_body()),
            model_info=nginx_string(payloads.model_info_body()),
            chat_path=payloads.CHAT_PATH,
            chat_type=chat_type,
            chat_body=nginx_string(body),
        )
        for port, chat_type, body in (
            (json_port, "application/json", payloads.chat_completion_body()),
            (stream_port, "text/event-stream", payloads.chat_stream_body()),
        )
    ]
    return _MAIN_TEMPLATE.format(run_dir=run_dir, servers="".join(servers))


def proxy_config(run_dir: Path, port: int, upstream_port: int) -> str:
    """nginx as a keep-alive reverse proxy in front of the backend: the compiled-proxy reference."""
    server = _PROXY_SERVER.format(port=port, upstream_port=upstream_port)
    return _MAIN_TEMPLATE.format(run_dir=run_dir, servers=server)


def write_config(run_dir: Path, text: str) -> Path:
    """Write ``nginx.conf`` into ``run_dir`` (created if needed) and return its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "nginx.conf"
    path.write_text(text)
    return path
