"""A loopback fake of the Hub endpoints that `HfApi.create_repo`, `create_branch` and `upload_folder` call in
huggingface_hub 2.4 (hf_api.py: create_repo, create_branch, _validate_yaml; _commit_api.py: _fetch_upload_modes,
_send_commit):

    POST /api/repos/create                          {"name", "organization", "visibility"?}
    POST /api/validate-yaml                         {"content", "repoType"}  (README.md metadata)
    POST /api/models/{repo}/branch/{branch}         {"startingPoint"?}
    POST /api/models/{repo}/preupload/{revision}    {"files": [{"path", "sample", "size"}]}
    POST /api/models/{repo}/commit/{revision}       NDJSON: a header line, then one line per file

Every file is declared "regular" at preupload, so its content arrives base64-encoded in the commit (no LFS/Xet
transfer). It binds 127.0.0.1 only, serves at most `max_requests` requests or `lifetime` seconds and then stops by
itself, and records what was committed. `fail={"commit": 403}` makes an endpoint (create_repo, branch, preupload,
commit) answer with that status; huggingface_hub retries 408/429/5xx answers to preupload and commit with backoff
(about 23 s in all), not those to create_repo or create_branch.
"""

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import unquote, urlsplit

import yaml


@dataclass
class Commit:
    repo_id: str
    revision: str
    summary: str
    description: str
    files: dict[str, bytes]


class FakeHub:
    """`with FakeHub() as hub:` serves at `hub.endpoint` until the block ends."""

    def __init__(self, fail: dict[str, int] | None = None, max_requests: int = 50, lifetime: float = 300.0):
        self.fail = fail or {}
        self.max_requests, self.lifetime = max_requests, lifetime
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "branches": {name: {path: bytes}}}
        self.commits: list[Commit] = []
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header)
        self._server = HTTPServer(("127.0.0.1", 0), self._handler())
        self._server.timeout = 0.1  # handle_request returns this often when idle, so the loop sees stop/deadline
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()
        self._server.server_close()

    def _serve(self):
        deadline = time.monotonic() + self.lifetime
        while not self._stop.is_set() and len(self.requests) < self.max_requests and time.monotonic() < deadline:
            self._server.handle_request()

    # -- endpoints: (status, JSON body) -----------------------------------------------------------------------------

    def create_repo(self, body):
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"}
        self.repos[repo_id] = {"private": body.get("visibility") == "private", "branches": {"main": {}}}
        return 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id}

    def validate_yaml(self, body):
        match = re.match(r"^---\n(.*?)\n---\n", body["content"], re.DOTALL)
        try:
            metadata = yaml.safe_load(match.group(1)) if match else None
        except yaml.YAMLError as error:
            return 400, {"errors": [{"message": f"invalid YAML: {error}"}], "warnings": []}
        warnings = [] if isinstance(metadata, dict) else [{"message": "empty or missing yaml metadata"}]
        return 200, {"errors": [], "warnings": warnings}

    def create_branch(self, repo_id, branch, body):
        branches = self.repos[repo_id]["branches"]
        if branch in branches:
            return 409, {"error": f"Reference refs/heads/{branch} already exists"}
        branches[branch] = dict(branches[body.get("startingPoint", "main")])
        return 200, {}

    def preupload(self, repo_id, revision, body):
        files = [{"path": file["path"], "uploadMode": "regular", "shouldIgnore": False} for file in body["files"]]
        return 200, {"files": files, "commitOid": "0" * 40}

    def commit(self, repo_id, revision, raw: bytes):
        lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
        header = lines[0]["value"]
        files = {}
        for line in lines[1:]:
            if line["key"] != "file":  # this fake only announces "regular" uploads
                return 400, {"error": f"unexpected commit operation {line['key']!r}"}
            files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        self.commits.append(Commit(repo_id, revision, header["summary"], header.get("description", ""), files))
        self.repos[repo_id]["branches"][revision].update(files)
        oid = hashlib.sha1(raw).hexdigest()
        return 200, {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

    def route(self, method: str, path: str, raw: bytes):
        if method != "POST":
            return 405, {"error": f"{method} is not served by this fake"}
        name = "create_repo" if path == "/api/repos/create" else path.split("/")[-2]
        if name in self.fail:
            return self.fail[name], {"error": f"{name} refused by the fake Hub (HTTP {self.fail[name]})"}
        if path == "/api/repos/create":
            return self.create_repo(json.loads(raw))
        if path == "/api/validate-yaml":
            return self.validate_yaml(json.loads(raw))
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(branch|preupload|commit)/([^/]+)", path)
        if not match:
            return 404, {"error": f"no route for {path}"}
        repo_id, action, ref = match.group(1), match.group(2), unquote(match.group(3))
        if repo_id not in self.repos:
            return 404, {"error": "Repository not found"}
        if action == "branch":
            return self.create_branch(repo_id, ref, json.loads(raw or b"{}"))
        if ref not in self.repos[repo_id]["branches"]:
            return 404, {"error": f"Invalid rev id: {ref}"}
        if action == "preupload":
            return self.preupload(repo_id, ref, json.loads(raw))
        return self.commit(repo_id, ref, raw)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: the serve loop counts requests

            def do_POST(self):
                self._answer()

            def do_GET(self):
                self._answer()

            def _answer(self):
                path = urlsplit(self.path).path
                hub.requests.append((self.command, path, self.headers.get("Authorization")))
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, body = hub.route(self.command, path, raw)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):  # keep test output quiet
                pass

        return Handler
