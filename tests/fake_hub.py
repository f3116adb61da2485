"""A loopback fake of the Hub endpoints that `HfApi.create_repo`, `create_branch` and `upload_folder` call in
huggingface_hub 2.4 (hf_api.py: create_repo, create_branch, _validate_yaml; _commit_api.py: _fetch_upload_modes,
_send_commit):

    POST /api/repos/create                          {"name", "organization", "visibility"?}
    POST /api/validate-yaml                         {"content", "repoType"}  (README.md metadata)
    POST /api/models/{repo}/branch/{branch}         {"startingPoint"?}
    POST /api/models/{repo}/preupload/{revision}    {"files": [{"path", "sample", "size"}]}
    POST /api/models/{repo}/commit/{revision}       NDJSON: a header line, then one line per file

and the read endpoints that `AutoModel.from_pretrained(repo, trust_remote_code=True)` and
`generate(custom_generate=repo, trust_remote_code=True)` call in transformers 5.23 (utils/hub.py: resolve_revision ->
HfApi.resolve_revision, which pins a branch to its commit id; hf_hub_download's get_hf_file_metadata and http_get;
has_file):

    GET /api/models/{repo}[/revision/{revision}]    {"id", "sha", "private", "siblings"}  (HfApi.model_info)
    HEAD, GET /{repo}/resolve/{revision}/{path}     the file as committed; revision: a branch or a commit id

Every file is declared "regular" at preupload, so its content arrives base64-encoded in the commit (no LFS/Xet
transfer) and is served back as a regular git file: no redirect, no X-Linked-* headers. It binds 127.0.0.1 only,
serves at most `max_requests` requests or `lifetime` seconds and then stops by itself, and records what was committed.
`fail={"commit": 403}` makes an endpoint (create_repo, branch, preupload, commit) answer with that status;
huggingface_hub retries 408/429/5xx answers to preupload and commit with backoff (about 23 s in all), not those to
create_repo or create_branch.
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
        # repo id -> {"private": bool, "branches": {name: commit id}, "trees": {commit id: {path: bytes}}}
        self.repos: dict[str, dict] = {}
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
        initial = hashlib.sha1(f"initial commit of {repo_id}".encode()).hexdigest()  # the Hub's repos start with one
        self.repos[repo_id] = {
            "private": body.get("visibility") == "private", "branches": {"main": initial}, "trees": {initial: {}}
        }
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
        branches[branch] = branches[body.get("startingPoint", "main")]
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
        repo = self.repos[repo_id]
        parent = repo["branches"][revision]
        oid = hashlib.sha1(parent.encode() + raw).hexdigest()
        repo["trees"][oid] = repo["trees"][parent] | files  # each commit keeps its own tree: old ids stay readable
        repo["branches"][revision] = oid
        return 200, {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

    def find_commit(self, repo_id, revision):
        """(commit id, None) or (None, the 404 answer); the X-Error-Code is what huggingface_hub turns into
        RepositoryNotFoundError / RevisionNotFoundError."""
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, (404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        oid = repo["branches"].get(revision, revision if revision in repo["trees"] else None)
        if oid is None:
            return None, (404, {"error": f"Invalid rev id: {revision}"}, {"X-Error-Code": "RevisionNotFound"})
        return oid, None

    def model_info(self, repo_id, revision):
        oid, missing = self.find_commit(repo_id, revision)
        if missing:
            return missing
        siblings = [{"rfilename": path} for path in sorted(self.repos[repo_id]["trees"][oid])]
        return 200, {"id": repo_id, "sha": oid, "private": self.repos[repo_id]["private"], "siblings": siblings}

    def resolve(self, repo_id, revision, path):
        """A file as `get_hf_file_metadata` reads it: X-Repo-Commit and ETag (the git blob id, as the Hub gives for
        non-LFS files) are required, Content-Length is the size. A missing file is an EntryNotFound 404 (has_file:
        False)."""
        oid, missing = self.find_commit(repo_id, revision)
        if missing:
            return missing
        content = self.repos[repo_id]["trees"][oid].get(path)
        if content is None:  # X-Repo-Commit here lets huggingface_hub cache the miss under .no_exist/<commit>
            return 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": oid}
        blob_id = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        return 200, content, {"ETag": f'"{blob_id}"', "X-Repo-Commit": oid, "Content-Type": "application/octet-stream"}

    def route(self, method: str, path: str, raw: bytes):
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if method == "GET" and info:
            return self.model_info(info.group(1), unquote(info.group(2) or "main"))
        download = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if method in ("GET", "HEAD") and download:
            return self.resolve(*(unquote(group) for group in download.groups()))
        if method != "POST":
            return 405, {"error": f"{method} {path} is not served by this fake"}
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

            def do_HEAD(self):  # the same status and headers as GET, no body
                self._answer()

            def _answer(self):
                path = urlsplit(self.path).path
                hub.requests.append((self.command, path, self.headers.get("Authorization")))
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, body, *headers = hub.route(self.command, path, raw)
                payload = body if isinstance(body, bytes) else json.dumps(body).encode()
                headers = {"Content-Type": "application/json"} | (headers[0] if headers else {})
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def log_message(self, *args):  # keep test output quiet
                pass

        return Handler
