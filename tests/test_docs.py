"""Every repository path and Python name the documents cite exists.

Documents: README.md, RESULTS.md and every `*.md` under docs/ (`test_citations_exist`);
WORKSPACE.md on its own (`test_workspace_citations_exist`). Citations are inline code spans
(text between matching runs of backticks, which may wrap a line) and markdown link targets;
inside fenced code blocks only command lines are read (rule 9). Each offender is reported
as `file:line: span: why`. Rules, applied to a span in this order:

 1. Skipped: empty spans, quoted strings ('x', "x"), CLI flags (-x, --x), numbers.
 2. A call `name(args)` (the whole span): `name` is checked as a dotted name (rule 7) or a
    bare name (rule 8; `name()` with empty parentheses always counts as code), and every
    `keyword=` inside the parentheses must be a known name.
 3. `name=value` without spaces: `name` must be a known name (or one of `EXTERNAL_NAMES`).
 4. Any other span holding whitespace, or any of `[]{}<>|;&` and ` -> `, is an expression or
    a shell command: only what rule 9 reads in it is checked.
 5. `path::name` (`name` may be `Class.attr`): the path exists (rule 6) and the name is
    defined in that file (read with `ast`). `path:N` / `path:N-M`: the path exists and has
    line N.
 6. Paths. A span with `/` whose first part is a top-level entry (`TOP_LEVEL`: arcjax/,
    scheduler/, pallas_kernels/, tests/, scripts/, docs/, .ci/) must exist; a glob
    (`*`, `?`) must match at least one file. A relative path of a module (`engine/core.py`)
    or directory (`model/formats/`) not rooted there must be the tail of a path in the
    repository. Paths starting with `/`, `~` or `.` (other than .ci/), URLs, paths whose
    first part is an external project (`EXTERNAL_ROOTS`: vllm/, jax/ ...), and other
    relative paths (a command's outputs such as runs/x.json, Hub ids such as org/name) are
    not the repository's and are skipped. A bare file name ending in .py, .md, .sh, .json or
    .toml (`README.md`, `plan.py`) must name a file of the repository, at the root or below
    (globs too). Other file names (.gguf, .safetensors, .jsonl, .png ...) are data files
    outside the repository and are skipped.
 7. Dotted names (`a.b.c`, a trailing `()` ignored). Rooted at arcjax, scheduler or
    pallas_kernels: the longest prefix that is a module (file or package) must be followed
    by names that resolve in its source: a module-level definition, assignment or import
    (imports of our modules are followed), then class attributes (methods, class-level and
    annotated fields, nested classes, `self.x` assignments, inherited from our base
    classes; a class with `__getattr__` or a base outside our code accepts any known
    name). Rooted in an external package (`EXTERNAL_ROOTS`: jax, np, lax, torch ...):
    skipped. Rooted at one of our class names (`Engine.run_step`): the first attribute must
    resolve in that class as above. Otherwise (`runner.prepare`, `plan.decode_only`, an
    instance's attributes): every part after the first must be a known name.
 8. A bare identifier that looks like code (it contains `_`, is CamelCase with two or more
    capitals and a lowercase letter, or ends in `()`) must be a known name; ALL_CAPS
    names of other programs' environment variables (`EXTERNAL_NAMES`) are skipped.
    Identifiers that look like words (`plan`, `DELTA`) are not checked.
 9. Commands, in spans with whitespace and on the lines of fenced code blocks (lines
    joined at a trailing backslash, `#` comments dropped): every word that is a path
    rooted at a top-level entry (rule 6) must exist; after `python scripts/X.py` every
    `--flag` (before `|`, `;`, `&&` or a redirect) must be one that script defines with
    absl (`flags.DEFINE_*("name", ...)`, or the fields of a dataclass given to
    `define_flags`; `--noflag` for booleans and absl's own flags allowed); after
    `python -m M` with M rooted at our packages, M must be a module.
10. Link targets `[text](target)`: http(s)/mailto targets are skipped; others are paths
    relative to the document, which must exist; a `#fragment` must be the GitHub anchor of
    a heading of the target markdown file (or of the document itself).
11. Plain prose (outside code spans, links and fences): every word that is a path rooted at
    a top-level entry (`arcjax/bench/burst.py`, `docs/design/`, a glob) must exist, as in
    rule 6.

The repository's files are git's view of the working tree (tracked files plus untracked ones
.gitignore does not exclude; without git, a walk skipping hidden, build and output
directories), so an ignored build copy never makes a stale path pass. Known names are
collected with `ast` from every .py under arcjax/, scheduler/, pallas_kernels/, tests/ and
scripts/ (this file excepted: its examples of stale citations are not names): definitions
of functions and classes, their arguments, assigned and used variables (dataclass fields
included), attribute names, keyword-argument names, imported names, module and package
names, and the identifiers inside string constants without whitespace (environment
variables such as ARC_PREFILL_MAX_SEQS, policy and metric names, checkpoint tensor names
such as "rope_freqs.weight"). Docstrings and messages (strings with whitespace) are not
split into words, so a name mentioned only in prose does not count. Nothing of the project
is imported: the check reads files only.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("arcjax", "scheduler", "pallas_kernels", "tests", "scripts", "docs", ".ci")
SOURCE_DIRS = ("arcjax", "scheduler", "pallas_kernels", "tests", "scripts")
PACKAGES = ("arcjax", "scheduler", "pallas_kernels")
DOCUMENTS = ("README.md", "RESULTS.md")
WORKSPACE = "WORKSPACE.md"
SELF = "tests/test_docs.py"  # the checker: its examples of stale names must not count as names
CHECKED_SUFFIXES = (".py", ".md", ".sh", ".json", ".toml")
DATA_SUFFIXES = (".gguf", ".safetensors", ".jsonl", ".png", ".whl", ".txt", ".bin", ".yaml",
                 ".yml", ".csv", ".html", ".so", ".pt", ".npz", ".npy", ".log", ".orbax")
# Roots of names and paths that belong to other projects (Python packages, common aliases,
# repositories named in prose).
EXTERNAL_ROOTS = frozenset("""
    jax jnp lax np numpy pl plgpu mgpu torch transformers triton tl jax_triton jaxlib gguf
    llguidance tokenizers safetensors orbax flax optax ml_dtypes huggingface_hub hf pytest
    hypothesis os sys asyncio threading json re functools dataclasses math typing
    collections itertools time signal subprocess socket absl scipy matplotlib mistralrs
    httpx jinja2 tracemalloc gc fastapi uvicorn starlette openai pydantic prometheus_client
    vllm v1 xla XLA jsonschema accelerate statistics struct mmap hashlib random enum
    contextlib weakref queue concurrent logging pathlib shutil tempfile platform inspect
    io copy bisect heapq operator warnings traceback multiprocessing tqdm sentencepiece
    llama llama_cpp nano_vllm gemma jetstream triton-lang python3 python pip vm
""".split())
# Environment variables of other programs that the documents name.
EXTERNAL_NAMES = frozenset("""
    HF_HOME HF_HUB_OFFLINE HF_TOKEN HF_HUB_CACHE TRITON_INTERPRET RAYON_NUM_THREADS
    XLA_PYTHON_CLIENT_MEM_FRACTION XLA_FLAGS JAX_PLATFORMS JAX_COORDINATOR_ADDRESS
    JAX_NUM_PROCESSES JAX_PROCESS_ID PYTHONPATH CUDA_VISIBLE_DEVICES TRANSFORMERS_OFFLINE
""".split())
ABSL_FLAGS = frozenset("""
    help helpfull helpshort helpxml flagfile undefok logtostderr alsologtostderr log_dir
    verbosity v stderrthreshold showprefixforinfo only_check_args pdb pdb_post_mortem
    run_with_pdb run_with_profiling profile_file use_cprofile_for_profiling
""".split())

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IDENT = re.compile(IDENT)
_DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})+")
_CALL = re.compile(rf"({IDENT}(?:\.{IDENT})*)\((.*)\)", re.S)
_KWARG = re.compile(rf"(?<![\w.])({IDENT})=(?!=)")
_ASSIGN = re.compile(rf"({IDENT})=(\S*)")
_NUMBER = re.compile(r"[-+]?\d[\d,_.]*(?:e[-+]?\d+)?[a-zA-Z%]*")
_OPERATORS = re.compile(r"[\[\]{}<>|;&]| -> |\s")
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_TICKS = re.compile(r"`+")
_SPACE = re.compile(r"\s")
_FENCE = re.compile(r"^\s*(```|~~~)")
_LINE_SUFFIX = re.compile(r"(.+\.\w+):(\d+)(?:-(\d+))?")
_BARE_PATH = re.compile(r"(?<![\w/.~-])(?:%s)/[\w./*-]*[\w*/]"
                        % "|".join(re.escape(t) for t in TOP_LEVEL))


# ----------------------------------------------------------------------------------------
# What the repository holds: files, modules, names.


_SKIPPED_DIRS = ("__pycache__", "build", "dist", "runs", "out")


def _walk_files(root: Path) -> list[str]:
    """The repository's files: git's view (tracked, plus untracked files .gitignore does not
    exclude), or, without git, a walk that skips hidden, build and output directories."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
            capture_output=True, check=True, timeout=30).stdout.decode().split("\0")
        return sorted(f for f in listed if f and (root / f).is_file())
    except (OSError, subprocess.SubprocessError):
        pass
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part in _SKIPPED_DIRS or part.endswith(".egg-info")
               or (part.startswith(".") and part != ".ci") for part in rel.parts[:-1]):
            continue
        if p.is_file() and not rel.name.startswith("."):
            out.append(rel.as_posix())
    return sorted(out)


def _is_camel(name: str) -> bool:
    return (name[0].isupper() and any(c.islower() for c in name)
            and sum(c.isupper() for c in name) >= 2)


def _looks_like_code(name: str) -> bool:
    return "_" in name or _is_camel(name)


@dataclass
class _ClassInfo:
    attrs: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)  # simple names of the bases
    open: bool = False  # defines __getattr__


@dataclass
class _ModuleInfo:
    path: str
    # module-level name -> ("def",) | ("class", node) | ("value",) | ("import", module, name)
    top: dict[str, tuple] = field(default_factory=dict)


class Repo:
    """The files, modules and names of a source tree, read with `ast` (nothing imported)."""

    def __init__(self, root: Path):
        self.root = root
        self.files = _walk_files(root)
        self.file_set = set(self.files)
        self.dirs = {str(Path(f).parent.as_posix()) for f in self.files} - {"."}
        for d in list(self.dirs):
            parts = d.split("/")
            self.dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        self.names: set[str] = set()
        self.modules: dict[str, _ModuleInfo] = {}
        self.classes: dict[str, list[_ClassInfo]] = {}
        self._trees: dict[str, ast.Module] = {}
        self._class_nodes: dict[int, _ClassInfo] = {}  # id(ClassDef) -> its info
        self._flags: dict[str, set[str] | None] = {}  # script -> its absl flags
        for rel in self.files:
            top = rel.split("/")[0]
            if not rel.endswith(".py") or top not in SOURCE_DIRS or rel == SELF:
                continue
            text = (root / rel).read_text(encoding="utf-8")
            try:
                tree = ast.parse(text, rel)
            except SyntaxError:
                continue
            self._trees[rel] = tree
            self._collect_names(tree, rel)
            if top in PACKAGES:
                parts = rel[:-3].split("/")
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                self.modules[".".join(parts)] = self._module_info(tree, rel)

    # -- names ----------------------------------------------------------------------------

    def _collect_names(self, tree: ast.Module, rel: str) -> None:
        """Adds the file's names to `names` and its classes to `classes`, in one traversal
        (`self.x` assignments are credited to the innermost enclosing class)."""
        names = self.names
        names.update(rel[:-3].split("/"))
        stack: list[tuple[ast.AST, _ClassInfo | None]] = [(tree, None)]
        while stack:
            node, owner = stack.pop()
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
                owner = self._class_info(node)
                self._class_nodes[id(node)] = owner
                self.classes.setdefault(node.name, []).append(owner)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
                if (owner is not None and isinstance(node.ctx, ast.Store)
                        and isinstance(node.value, ast.Name)
                        and node.value.id in ("self", "cls")):
                    owner.attrs.add(node.attr)
            elif isinstance(node, ast.keyword):
                if node.arg:
                    names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.update(node.name.split("."))
                if node.asname:
                    names.add(node.asname)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                names.update(node.names)
            elif isinstance(node, ast.Constant):
                if isinstance(node.value, str) and not _SPACE.search(node.value):
                    names.update(_IDENT.findall(node.value))
                continue
            stack.extend((child, owner) for child in ast.iter_child_nodes(node))

    @staticmethod
    def _class_info(node: ast.ClassDef) -> _ClassInfo:
        """The class's own attributes (its `self.x` assignments are added by the caller)."""
        info = _ClassInfo()
        for b in node.bases:
            if isinstance(b, ast.Name):
                info.bases.append(b.id)
            elif isinstance(b, ast.Attribute):
                info.bases.append("." + b.attr)  # external (a dotted base)
            elif isinstance(b, ast.Subscript) and isinstance(b.value, ast.Name):
                info.bases.append(b.value.id)  # Generic[T], Protocol[T]
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                info.attrs.add(stmt.name)
                if stmt.name == "__getattr__":
                    info.open = True
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    info.attrs.update(_target_names(t))
            elif isinstance(stmt, ast.AnnAssign):
                info.attrs.update(_target_names(stmt.target))
        return info

    def _module_info(self, tree: ast.Module, rel: str) -> _ModuleInfo:
        info = _ModuleInfo(path=rel)
        package = rel[:-3].replace("/", ".")
        package = package.rpartition(".")[0] if not rel.endswith("__init__.py") else package[:-9]

        def visit(stmts):
            for s in stmts:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    info.top[s.name] = ("def",)
                elif isinstance(s, ast.ClassDef):
                    info.top[s.name] = ("class", s)
                elif isinstance(s, ast.Assign):
                    for t in s.targets:
                        for n in _target_names(t):
                            info.top[n] = ("value",)
                elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
                    for n in _target_names(s.target):
                        info.top[n] = ("value",)
                elif isinstance(s, ast.Import):
                    for a in s.names:
                        if a.asname:
                            info.top[a.asname] = ("import", a.name, None)
                        else:
                            root = a.name.split(".")[0]
                            info.top[root] = ("import", root, None)
                elif isinstance(s, ast.ImportFrom):
                    mod = s.module or ""
                    if s.level:
                        base = package.split(".")
                        base = base[:len(base) - (s.level - 1)]
                        mod = ".".join(base + ([mod] if mod else []))
                    for a in s.names:
                        info.top[a.asname or a.name] = ("import", mod, a.name)
                elif isinstance(s, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                    for block in ("body", "orelse", "finalbody"):
                        visit(getattr(s, block, []))
                    for h in getattr(s, "handlers", []):
                        visit(h.body)
        visit(tree.body)
        return info

    # -- resolution -----------------------------------------------------------------------

    def known(self, name: str) -> bool:
        return name in self.names

    def class_has(self, infos: list[_ClassInfo], attr: str, seen=None) -> bool:
        """Whether any of these classes (one name may be defined more than once) has attr."""
        seen = set() if seen is None else seen
        for info in infos:
            if attr in info.attrs:
                return True
            if info.open and self.known(attr):
                return True
            for base in info.bases:
                if base in seen:
                    continue
                seen.add(base)
                if base in self.classes:
                    if self.class_has(self.classes[base], attr, seen):
                        return True
                elif self.known(attr):  # a base outside our code: its attributes are unknown
                    return True
        return False

    def resolve_in_module(self, module: str, parts: list[str], depth: int = 0) -> bool:
        if not parts:
            return True
        if depth > 20:
            return False
        info = self.modules[module]
        entry = info.top.get(parts[0])
        if entry is None:
            sub = f"{module}.{parts[0]}"
            return sub in self.modules and self.resolve_in_module(sub, parts[1:], depth + 1)
        kind = entry[0]
        rest = parts[1:]
        if kind == "import":
            target, name = entry[1], entry[2]
            if target.split(".")[0] not in PACKAGES:
                return True  # an external module's attributes are not ours to check
            if name is None:
                return target in self.modules and self.resolve_in_module(target, rest, depth + 1)
            if f"{target}.{name}" in self.modules:
                return self.resolve_in_module(f"{target}.{name}", rest, depth + 1)
            return target in self.modules and self.resolve_in_module(target, [name] + rest,
                                                                     depth + 1)
        if kind == "def":
            return not rest
        if kind == "class":
            if not rest:
                return True
            infos = [self._class_nodes[id(entry[1])]]
            if not self.class_has(infos, rest[0]):
                return False
            return all(self.known(p) for p in rest[1:])
        return all(self.known(p) for p in rest)  # a value: its attributes are not read

    def resolve_dotted(self, name: str) -> bool:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            module = ".".join(parts[:n])
            if module in self.modules:
                return self.resolve_in_module(module, parts[n:])
        return False

    def defined_in_file(self, rel: str, name: str) -> bool:
        tree = self._trees.get(rel)
        if tree is None:
            return False
        parts = name.split(".")
        module = next((m for m, i in self.modules.items() if i.path == rel), None)
        if module is not None:
            return self.resolve_in_module(module, parts)
        # A test or script file: a definition anywhere in it, then a class attribute.
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == parts[0]:
                    if len(parts) == 1:
                        return True
                    if isinstance(node, ast.ClassDef):
                        return self.class_has([self._class_nodes[id(node)]], parts[1])
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if len(parts) == 1 and any(parts[0] in _target_names(t) for t in targets):
                    return True
        return False

    def script_flags(self, rel: str) -> set[str] | None:
        """The absl flags scripts/X.py defines, or None when it is not a Python file here."""
        if rel not in self._flags:
            self._flags[rel] = self._read_flags(rel)
        return self._flags[rel]

    def _read_flags(self, rel: str) -> set[str] | None:
        tree = self._trees.get(rel)
        if tree is None:
            return None
        out = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname.startswith("DEFINE_") and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    out.add(first.value)
            elif fname == "define_flags" and node.args and isinstance(node.args[0], ast.Name):
                prefix = ""
                for kw in node.keywords:
                    if kw.arg == "prefix" and isinstance(kw.value, ast.Constant):
                        prefix = kw.value.value
                if len(node.args) > 2 and isinstance(node.args[2], ast.Constant):
                    prefix = node.args[2].value
                out.update(prefix + f for f in self._dataclass_fields(tree, node.args[0].id))
        return out

    def _dataclass_fields(self, tree: ast.Module, cls: str) -> list[str]:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return [s.target.id for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if (a.asname or a.name) == cls and node.module in self.modules:
                        src = self._trees.get(self.modules[node.module].path)
                        if src is not None:
                            return self._dataclass_fields(src, a.name)
        return []


def _target_names(t: ast.AST) -> list[str]:
    if isinstance(t, ast.Name):
        return [t.id]
    if isinstance(t, (ast.Tuple, ast.List)):
        return [n for e in t.elts for n in _target_names(e)]
    if isinstance(t, ast.Starred):
        return _target_names(t.value)
    return []


@functools.lru_cache(maxsize=None)
def repo() -> Repo:
    return Repo(ROOT)


# ----------------------------------------------------------------------------------------
# Reading a document.


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    out, counts = set(), {}
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            slug = _slug(m.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _split_fences(text: str) -> tuple[str, list[tuple[int, str]]]:
    """(the text with fenced blocks blanked, [(line number, line) inside fences])."""
    prose, fenced = [], []
    in_fence = False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            prose.append("")
        elif in_fence:
            fenced.append((i, line))
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), fenced


def _spans(prose: str) -> list[tuple[int, str, int, int]]:
    """(line, content, start, end) of every inline code span; a span may wrap lines."""
    out = []
    pos = 0
    while True:
        m = _TICKS.search(prose, pos)
        if not m:
            return out
        ticks = m.group(0)
        close = re.compile(rf"(?<!`){ticks}(?!`)")
        end = close.search(prose, m.end())
        if end is None:  # an unmatched run is literal text
            pos = m.end()
            continue
        content = prose[m.end():end.start()]
        if "\n\n" not in content:
            line = prose.count("\n", 0, m.start()) + 1
            out.append((line, " ".join(content.split("\n")).strip()
                        if len(ticks) > 1 else content.replace("\n", " "), m.start(), end.end()))
            pos = end.end()
        else:
            pos = m.end()


def _blank(text: str, ranges) -> str:
    """`text` with the given (start, end) ranges replaced by spaces (newlines kept)."""
    chars = list(text)
    for start, end in ranges:
        for i in range(start, end):
            if chars[i] != "\n":
                chars[i] = " "
    return "".join(chars)


def _commands(fenced: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Fenced lines joined at trailing backslashes, comments dropped."""
    out, buf, start = [], "", 0
    for line_no, line in fenced:
        if not buf:
            start = line_no
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        out.append((start, buf))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


# ----------------------------------------------------------------------------------------
# The rules.


class Checker:
    """Checks the citations of one document against a `Repo`; `problems` holds the offenders."""

    def __init__(self, repository: Repo, doc: str, base: Path):
        self.repo = repository
        self.doc = doc
        self.base = base  # the document's directory, for relative links
        self.problems: list[str] = []

    def _bad(self, line: int, span: str, why: str) -> None:
        self.problems.append(f"{self.doc}:{line}: `{span}`: {why}")

    # -- paths ----------------------------------------------------------------------------

    def _path_ok(self, path: str) -> bool:
        path = path.rstrip("/") if path not in ("/",) else path
        files, dirs = self.repo.file_set, self.repo.dirs
        if any(c in path for c in "*?"):
            return any(fnmatch.fnmatchcase(f, path) for f in self.repo.files)
        return path in files or path in dirs

    def _tail_ok(self, path: str) -> bool:
        tail = path.rstrip("/")
        glob = any(c in tail for c in "*?")
        pool = self.repo.dirs if path.endswith("/") else self.repo.files
        for f in pool:
            if glob:
                parts = f.split("/")
                n = tail.count("/") + 1
                if len(parts) >= n and fnmatch.fnmatchcase("/".join(parts[-n:]), tail):
                    return True
            elif f == tail or f.endswith("/" + tail):
                return True
        return False

    def check_path(self, line: int, span: str, path: str) -> bool:
        """Rule 6 for `path`. Returns whether it was a path (checked or skipped as foreign)."""
        if "://" in path or path.startswith(("/", "~")):
            return True
        first = path.split("/")[0]
        if "/" in path:
            if first in TOP_LEVEL:
                if not self._path_ok(path):
                    self._bad(line, span, "no such path in the repository")
                return True
            if first.startswith(".") or first in EXTERNAL_ROOTS or "#" in path:
                return True
            if path.endswith(".py") or path.endswith("/"):
                if not self._tail_ok(path):
                    self._bad(line, span, "no repository path ends with it")
                return True
            return True  # outputs of commands (runs/...), Hub ids (org/name): not ours
        if path.endswith(CHECKED_SUFFIXES):
            name = path
            if not any(fnmatch.fnmatchcase(f.split("/")[-1], name) for f in self.repo.files):
                self._bad(line, span, "no file of this name in the repository")
            return True
        return False

    # -- names ----------------------------------------------------------------------------

    def check_name(self, line: int, span: str, name: str, called: bool = False) -> None:
        """Rules 7 and 8 for a dotted or bare name."""
        r = self.repo
        if "." in name:
            parts = name.split(".")
            root = parts[0]
            if root in PACKAGES:
                if not r.resolve_dotted(name):
                    self._bad(line, span, "does not resolve in the source")
            elif root in EXTERNAL_ROOTS:
                return
            elif root in r.classes:
                if not r.class_has(r.classes[root], parts[1]):
                    self._bad(line, span, f"class {root} has no attribute {parts[1]!r}")
                elif not all(r.known(p) for p in parts[2:]):
                    self._bad(line, span, "unknown attribute name")
            elif not all(r.known(p) for p in parts[1:]):
                missing = [p for p in parts[1:] if not r.known(p)]
                self._bad(line, span, f"unknown name {missing[0]!r}")
            return
        if not (called or _looks_like_code(name)):
            return
        if name.isupper() and name in EXTERNAL_NAMES:
            return
        if not r.known(name):
            self._bad(line, span, "not defined or used in any Python source")

    # -- commands -------------------------------------------------------------------------

    def check_command(self, line: int, text: str, span: str | None = None) -> None:
        """Rule 9 for one command line (a span with spaces or a fenced line)."""
        shown = span if span is not None else text.strip()
        words = text.split("#")[0].split() if span is None else text.split()
        script = None
        for i, word in enumerate(words):
            clean = word.strip("'\"(),;`")
            if word in ("|", ";", "&&", "||", ">", ">>", "2>&1") or word.startswith((">", "<")):
                script = None
                continue
            if clean.startswith("--") and script is not None:
                flag = clean[2:].split("=")[0]
                flags = self.repo.script_flags(script)
                if flags is not None and flag and not (
                        flag in flags or flag in ABSL_FLAGS
                        or (flag.startswith("no") and flag[2:] in flags)):
                    self._bad(line, shown, f"{script} defines no flag --{flag}")
                continue
            if i > 0 and words[i - 1] == "-m" and clean.split(".")[0] in PACKAGES:
                if clean not in self.repo.modules:
                    self._bad(line, shown, f"no module {clean}")
                continue
            if "=" in clean and not clean.startswith(TOP_LEVEL):
                clean = clean.split("=", 1)[1]  # VAR=path, --x=path
            if "/" in clean and clean.split("/")[0] in TOP_LEVEL:
                self.check_path(line, shown, clean)
                if clean.startswith("scripts/") and clean.endswith(".py"):
                    script = clean

    # -- one span -------------------------------------------------------------------------

    def check_span(self, line: int, span: str) -> None:
        s = span.strip()
        if not s or s[0] in "'\"" and s[-1] == s[0] and len(s) > 1:
            return
        if s.startswith("-") and not _NUMBER.fullmatch(s):
            return
        if _NUMBER.fullmatch(s):
            return
        call = _CALL.fullmatch(s)
        if call and call.group(2).count("(") == call.group(2).count(")"):
            callee, args = call.group(1), call.group(2)
            self.check_name(line, s, callee, called=not args.strip())
            inner = re.sub(r"'[^']*'|\"[^\"]*\"", "", args)
            for kw in _KWARG.findall(inner):
                if not self.repo.known(kw):
                    self._bad(line, s, f"unknown keyword {kw!r}")
            return
        assign = _ASSIGN.fullmatch(s)
        if assign:
            if assign.group(1) not in EXTERNAL_NAMES and not self.repo.known(assign.group(1)):
                self._bad(line, s, f"unknown name {assign.group(1)!r}")
            return
        if _OPERATORS.search(s):
            self.check_command(line, s, span=s)
            return
        if "::" in s:
            path, _, name = s.partition("::")
            if self.check_path(line, s, path) and path.split("/")[0] in TOP_LEVEL:
                if self._path_ok(path) and not self.repo.defined_in_file(path, name):
                    self._bad(line, s, f"{name} is not defined in {path}")
            return
        m = _LINE_SUFFIX.fullmatch(s)
        if m and ("/" in m.group(1) or m.group(1).endswith(CHECKED_SUFFIXES)):
            path, first = m.group(1), int(m.group(2))
            self.check_path(line, s, path)
            if path in self.repo.file_set:
                n = len((self.repo.root / path).read_text(encoding="utf-8").splitlines())
                if first > n:
                    self._bad(line, s, f"{path} has {n} lines")
            return
        if "/" in s or s.endswith(CHECKED_SUFFIXES):
            self.check_path(line, s, s)
            return
        if s.endswith(DATA_SUFFIXES):
            return
        called = s.endswith("()")
        name = s[:-2] if called else s
        if _DOTTED.fullmatch(name) or _IDENT.fullmatch(name):
            self.check_name(line, s, name, called=called)

    # -- links ----------------------------------------------------------------------------

    def check_link(self, line: int, target: str, own_text: str) -> None:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            return
        path, _, fragment = target.partition("#")
        if path:
            resolved = (self.base / path).resolve()
            try:
                rel = resolved.relative_to(self.repo.root).as_posix()
            except ValueError:
                self._bad(line, target, "link leaves the repository")
                return
            if rel not in self.repo.file_set and rel not in self.repo.dirs:
                self._bad(line, target, "link target does not exist")
                return
            if fragment and rel.endswith(".md"):
                text = (self.repo.root / rel).read_text(encoding="utf-8")
                if fragment not in anchors(text):
                    self._bad(line, target, f"no heading #{fragment} in {rel}")
        elif fragment and fragment not in anchors(own_text):
            self._bad(line, target, f"no heading #{fragment} here")

    def check_text(self, text: str) -> list[str]:
        prose, fenced = _split_fences(text)
        spans = _spans(prose)
        for line, span, _, _ in spans:
            self.check_span(line, span)
        links = list(_LINK.finditer(prose))
        for m in links:
            self.check_link(prose.count("\n", 0, m.start()) + 1, m.group(1), text)
        for line, command in _commands(fenced):
            self.check_command(line, command)
        bare = _blank(prose, [(a, b) for _, _, a, b in spans] + [m.span() for m in links])
        for m in _BARE_PATH.finditer(bare):
            self.check_path(bare.count("\n", 0, m.start()) + 1, m.group(0), m.group(0))
        return self.problems


def check_document(rel: str, repository: Repo | None = None) -> list[str]:
    repository = repository or repo()
    path = repository.root / rel
    return Checker(repository, rel, path.parent).check_text(path.read_text(encoding="utf-8"))


def documents() -> list[str]:
    docs = sorted(f for f in repo().files if f.startswith("docs/") and f.endswith(".md"))
    return [d for d in DOCUMENTS if (ROOT / d).exists()] + docs


# ----------------------------------------------------------------------------------------
# The tests.


def test_citations_exist():
    problems = [p for doc in documents() for p in check_document(doc)]
    assert not problems, "stale citations:\n" + "\n".join(problems)


def test_workspace_citations_exist():
    problems = check_document(WORKSPACE)
    assert not problems, "stale citations:\n" + "\n".join(problems)


def _check(text: str) -> list[str]:
    return Checker(repo(), "memory.md", ROOT).check_text(text)


def test_checker_catches_missing_paths_names_and_links():
    text = "\n".join([
        "A gone module `arcjax/burst.py`, a gone glob `tests/test_nothing_*.py`,",
        "a gone helper `_iterate`, a gone call `_iterate()`, a gone class `StepRecordz`,",
        "a gone dotted name `arcjax.engine.core.EngineCore._iterate`, `scheduler.nope`,",
        "a gone class attribute `Engine._iterate_forever`, a relative `runtime/ngram.py`,",
        "a missing definition `arcjax/engine/core.py::nothing_here`, a line past the end",
        "`scheduler/policies.py:100000`, a link [x](docs/nowhere.md), an anchor",
        "[y](RESULTS.md#no-such-section), a bad keyword `SamplingParams(max_tokenz=3)`,",
        "a path in plain prose (arcjax/costmodel.py, as built) and a bad flag:",
        "```",
        "python scripts/bench_burst.py --num_users=32 \\",
        "  --no_such_flag=1",
        "```",
    ])
    problems = _check(text)
    for expected in ("`arcjax/burst.py`", "`tests/test_nothing_*.py`", "`_iterate`",
                     "`_iterate()`", "`StepRecordz`", "`arcjax.engine.core.EngineCore._iterate`",
                     "`scheduler.nope`", "`Engine._iterate_forever`", "`runtime/ngram.py`",
                     "`arcjax/engine/core.py::nothing_here`", "`scheduler/policies.py:100000`",
                     "`docs/nowhere.md`", "`RESULTS.md#no-such-section`",
                     "`SamplingParams(max_tokenz=3)`", "`arcjax/costmodel.py`", "--no_such_flag"):
        assert any(expected in p for p in problems), (expected, problems)
    assert all(p.startswith("memory.md:") for p in problems)
    assert "memory.md:1: `arcjax/burst.py`" in problems[0]
    assert len(problems) == 16, problems


def test_checker_accepts_what_exists():
    text = "\n".join([
        "`arcjax/engine/core.py`, `tests/test_structured_*.py`, `engine/core.py`,",
        "`model/formats/`, `plan.py`, `README.md`, `EngineCore`, `_step_overlapped`,",
        "`prepare()`, `ARC_PREFILL_MAX_SEQS`, `arcjax.LLM`, `arcjax.engine.core.EngineCore.step`,",
        "`scheduler.schedule`, `scheduler.metrics.summarize`, `pallas_kernels.resolve_impl`,",
        "`Engine.run_step`, `runner.prepare`, `arcjax/engine/core.py::EngineCore.step`,",
        "`scheduler/policies.py:1`, `jax.lax.ragged_dot`, `np.argsort`, `\"auto\"`,",
        "`--max-num-seqs`, `0.15`, `[T, H]`, `plan = scheduler.schedule(state, config)`,",
        "`SamplingParams(max_tokens=64, temperature=0.8)`, `enable_prefix_caching=False`,",
        "`runs/out.json`, `Qwen/Qwen3-8B`, `model.gguf`, `HF_HOME`, `DELTA`, `plan`,",
        "[results](RESULTS.md), [this](#the-heading), [h](https://example.org/x),",
        "prose paths docs/design/ and tests/test_engine*.py, and an URL https://x.org/arcjax/no.",
        "# The heading",
        "```",
        "python scripts/bench_burst.py --num_users=32 --nocompare --out=runs/x.json | tee log",
        "python -m arcjax.serve --port 8000",
        "```",
    ])
    assert _check(text) == []


def test_anchors_follow_github():
    text = "# A `code` title, with: punctuation!\n## Repeat\n## Repeat\n```\n# not a heading\n```\n"
    assert anchors(text) == {"a-code-title-with-punctuation", "repeat", "repeat-1"}
