"""The layout says the architecture: the library never imports the application, no module imports itself back, every
error class lives in `errors.py`, the test helpers stay out of the package, and `import grpo_hf` / `grpo-hf --help`
import neither torch nor transformers. In the application, no function is longer than 80 lines, and a recipe's path
(`grpo-hf compare recipes/tiny.yaml`, from the command line to the report) crosses at most ten of its files.

The imports are read from the source (ast), every `import` statement of a module: at its top level, in functions and
methods, and under `if TYPE_CHECKING:`.
"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_hf


PACKAGE = Path(grpo_hf.__file__).resolve().parent
# The application around the library: sub-packages the library must never import.
APPLICATION = ("grpo_hf.cli", "grpo_hf.harness", "grpo_hf.hub")
HEAVY = ("torch", "transformers", "accelerate", "peft", "datasets")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(path): path
    for path in sorted(PACKAGE.rglob("*.py"))
    if "recipes" not in path.relative_to(PACKAGE).parts  # the data folder's scripts are not modules of grpo_hf
    and path.parent.parent.name != "metrics"  # evaluate's metric scripts, loaded by path
}


def is_application(name: str) -> bool:
    return any(name == app or name.startswith(app + ".") for app in APPLICATION)


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> list[str]:
    """The grpo_hf modules a `from ... import ...` statement imports (a submodule when a name is one)."""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if not base.startswith("grpo_hf"):
        return []
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def imports_of(module: str, module_level_only: bool = False) -> set[str]:
    """The grpo_hf modules `module` imports: anywhere in it, or only in statements run when it is imported."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if module_level_only:  # top-level statements, descending into if/try blocks but not into functions or classes
        nodes, stack = [], list(tree.body)
        while stack:
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                stack += [n for block in ("body", "orelse", "finalbody", "handlers") for n in getattr(node, block, [])]
            elif isinstance(node, ast.ExceptHandler):
                stack += node.body
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            found.update(_resolve(module, path, node))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "grpo_hf")
    return found - {module}


def test_the_modules_are_found():
    assert {"grpo_hf.trainer", "grpo_hf.cli.main", "grpo_hf.harness.compare", "grpo_hf.hub.upload"} <= set(MODULES)
    assert {name for name in MODULES if is_application(name)} > {"grpo_hf.cli", "grpo_hf.harness", "grpo_hf.hub"}


@pytest.mark.parametrize("module", [name for name in MODULES if not is_application(name)])
def test_the_library_never_imports_the_application(module):
    bad = sorted(name for name in imports_of(module) if is_application(name))
    assert not bad, f"{module} (library) imports {bad} (application)"


def with_packages(module: str, imported: set[str]) -> set[str]:
    """`imported` plus the packages whose `__init__` importing them runs: those `module` is not inside already."""
    found = set()
    for name in imported:
        parts = name.split(".")
        for end in range(2, len(parts) + 1):
            package = ".".join(parts[:end])
            if end == len(parts) or not (module == package or module.startswith(package + ".")):
                found.add(package)
    return found


# How a library module could name the application without importing it: a dotted or path name of one of its
# packages, or a module of it by its (distinctive) name.
# e.g. `offline_models`, `recipe_files`: the application's modules whose names say which they are
DISTINCT_NAMES = sorted(
    {
        last
        for last in (name.rsplit(".", 1)[-1] for name in MODULES if is_application(name))
        if last.strip("_").count("_")
    }
)
APPLICATION_NAMES = re.compile(
    rf"grpo_hf[./](cli|harness|hub|recipes)\b|\b(cli|harness|hub)/|\b({'|'.join(DISTINCT_NAMES)})\b"
)


@pytest.mark.parametrize("module", [name for name in MODULES if not is_application(name)])
def test_the_library_names_no_application_module(module):
    # even in strings, docstrings and comments: what the library says must hold without the application
    text = MODULES[module].read_text(encoding="utf-8")
    found = [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if APPLICATION_NAMES.search(line)]
    assert not found, f"{module} (library) names the application:\n" + "\n".join(found)


def test_no_import_cycle_among_grpo_hf_modules():
    # Every import counts, a function-level one too (a lazy import only hides a cycle), and importing `a.b.c` from
    # outside `a.b` runs `a/b/__init__.py` first (`grouping -> compression.spec` runs `compression/__init__`).
    graph = {module: with_packages(module, imports_of(module)) & set(MODULES) - {module} for module in MODULES}
    done, path = set(), []

    def visit(module):
        if module in path:
            cycle = path[path.index(module) :] + [module]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_every_error_class_is_in_errors_py():
    defined = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base) for base in node.bases]
                if node.name.endswith(("Error", "Exception", "Unavailable")) or any(
                    base.endswith(("Error", "Exception")) for base in bases
                ):
                    defined.setdefault(module, []).append(node.name)
    assert set(defined) == {"grpo_hf.errors"}, defined


def test_the_test_helpers_are_not_in_the_package():
    assert not [path.name for path in PACKAGE.rglob("test*.py")]
    assert (Path(__file__).parent / "testing_utils.py").is_file()


def test_the_public_names_are_exported_lazily():
    from grpo_hf import _EXPORTS  # the table behind the lazy module

    assert grpo_hf.__all__ == list(_EXPORTS)
    assert set(grpo_hf.__all__) | {"__version__"} <= set(dir(grpo_hf))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        grpo_hf.NoSuchName  # noqa: B018


def _modules_after(code: str) -> set[str]:
    """The top-level packages imported by a fresh interpreter that runs `code`."""
    script = f"import sys\n{code}\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.splitlines()[-1].split())  # the last line: --help prints above it


def test_import_grpo_hf_imports_nothing_heavy():
    assert not _modules_after("import grpo_hf") & set(HEAVY)


def test_grpo_hf_help_and_bad_command_lines_import_nothing_heavy(tmp_path):
    code = (
        "from grpo_hf.cli.main import main\n"
        "for argv in ([], ['--help'], ['bogus'], ['--debug']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"assert main(['train', {str(tmp_path / 'missing.yaml')!r}]) == 2\n"
        f"assert main(['compare', {str(tmp_path)!r}]) == 2\n"
        f"assert main(['publish', {str(tmp_path)!r}, '--repo_id', 'not a repo', '--dry_run']) == 2\n"
        f"assert main(['publish', {str(tmp_path)!r}, '--repo_id', 'me/model', '--dry_run']) == 2\n"
        "for argv in (['env', '--bad'], ['publish']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
    )
    assert not _modules_after(code) & set(HEAVY)


def test_groups_help_version_and_recipes_import_nothing_heavy():
    # `grpo-hf groups --help` took 4 s while it imported GRPOConfig (transformers) for its help texts.
    code = (
        "from grpo_hf.cli.main import main\n"
        "for argv in (['groups', '--help'], ['publish', '--help'], ['recipes', '--help'], ['--version']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert main(['recipes']) == 0\n"
    )
    assert not _modules_after(code) & set(HEAVY)


# --- the application: short functions, and a recipe's path through few files ---

APPLICATION_FOLDERS = [PACKAGE / "cli", PACKAGE / "harness"]
# The most files of the application (`cli/`, `harness/`) that `grpo-hf compare recipes/tiny.yaml` enters.
RECIPE_PATH_FILES = 10
# Runs a command line of `grpo-hf` in a fresh interpreter and prints, as JSON, every grpo_hf file one of whose
# functions was called: a file only imported, or whose classes were only defined, is not entered.
PATH_SCRIPT = """
import inspect, json, os, sys, threading
import grpo_hf
root = os.path.dirname(grpo_hf.__file__)
entered = set()
def profile(frame, event, arg):
    code = frame.f_code
    if event == "call" and code.co_flags & inspect.CO_NEWLOCALS and code.co_filename.startswith(root + os.sep):
        entered.add(os.path.relpath(code.co_filename, os.path.dirname(root)).replace(os.sep, "/"))
threading.setprofile(profile)
sys.setprofile(profile)
from grpo_hf.cli.main import main
status = main(sys.argv[1:])
sys.setprofile(None)
threading.setprofile(None)
print(json.dumps({"status": status, "entered": sorted(entered)}))
"""


@pytest.mark.parametrize("folder", APPLICATION_FOLDERS, ids=lambda folder: folder.name)
def test_no_function_of_the_application_is_longer_than_80_lines(folder):
    long = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno > 80:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not long, f"longer than 80 lines: {long}"


@pytest.mark.slow  # the tiny recipe, Trainer and GRPOTrainer with their timed windows: ~30 s on 2 cores
def test_a_recipe_crosses_at_most_ten_application_files(tmp_path):
    """
    The files of grpo_hf that `grpo-hf compare recipes/tiny.yaml` goes through, from the command line to the report:
    the application's (`cli/`, `harness/`) at most [`RECIPE_PATH_FILES`]; the library's are listed beside them. Run
    with `-s` to see both lists.
    """
    argv = ["compare", str(PACKAGE / "recipes" / "tiny.yaml"), "--output_dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, "-c", PATH_SCRIPT, *argv], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["status"] == 0
    application = [f for f in result["entered"] if f.startswith(("grpo_hf/cli/", "grpo_hf/harness/"))]
    library = [f for f in result["entered"] if f not in application]
    print(f"\napplication: {len(application)} files\n  " + "\n  ".join(application))
    print(f"library: {len(library)} files\n  " + "\n  ".join(library))
    assert len(application) <= RECIPE_PATH_FILES, application


# --- the library: a DDP bucket's path to the kernels ---

# The most files of grpo_hf on the stack when a bucket's data reaches a kernel of `codec.py` from `grpo_comm_hook`.
BUCKET_PATH_FILES = 5


@pytest.mark.parametrize("mode, density", [("allgather", 1.0), ("allreduce", 1.0), ("allgather", 0.1)])
def test_a_ddp_bucket_reaches_the_kernels_through_at_most_five_files(mode, density):
    """
    The files between `grpo_comm_hook` and the encode / decode kernels, read off the stack at every kernel call of one
    compressed step: `hook.py` -> `exchange.py` (the seam of the three transports) -> `codes/<the code>.py` ->
    `codec.py`. Run with `-s` to see them, and every file the step enters (`layout.py` and
    `state.py` give the rows and residuals, `traffic.py` counts the bytes).
    """
    import torch
    from testing_utils import FakeBucket
    from torch import nn

    from grpo_hf.compression import CodecSpec, GRPOCommState, grpo_comm_hook

    model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 256))
    plan = {n: CodecSpec(density=density, bits=8) if p.dim() == 2 else None for n, p in model.named_parameters()}
    state = GRPOCommState(plan, mode=mode, dense_warmup_steps=0, compile_codec=False).bind(model)
    params = list(model.parameters())
    root = str(PACKAGE) + "/"
    entered, stacks = set(), set()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event != "call" or not name.startswith(root):
            return
        entered.add(name[len(root) :])
        if frame.f_code.co_name in ("encode_blocks", "decode_blocks"):
            files = []
            while frame is not None:
                if frame.f_code.co_filename.startswith(root) and frame.f_code.co_filename[len(root) :] not in files:
                    files.append(frame.f_code.co_filename[len(root) :])
                frame = frame.f_back
            stacks.add(tuple(reversed(files)))

    sys.setprofile(profile)
    try:
        grpo_comm_hook(state, FakeBucket(params, [torch.randn_like(p) for p in params])).wait()
    finally:
        sys.setprofile(None)
    assert state.last_step == "compressed" and stacks
    print(f"\n{mode}, density {density}: " + "; ".join(" -> ".join(files) for files in sorted(stacks)))
    print("  entered: " + ", ".join(sorted(entered)))
    assert all(len(files) <= BUCKET_PATH_FILES for files in stacks), stacks
    assert all(files[0] == "compression/hook.py" and "compression/exchange.py" in files for files in stacks), stacks


def _loopback(world_size: int):
    """A `Communicator` of `W` ranks that all send what this one sends: the shapes of every collective, without a
    process group (what the path tests need; the values are checked by the distributed tests). Handed to a transport
    through the door a real one comes in by."""
    import torch
    import torch.distributed as dist

    from grpo_hf.compression.communicator import Communicator

    class Loopback(Communicator):
        rank = 0

        def _all_reduce(self, tensor, op):
            if op != dist.ReduceOp.MAX:
                tensor.mul_(self.world_size)
            return []

        def _all_gather_into(self, out, mine, tag):
            out.view(self.world_size, -1).copy_(mine.reshape(1, -1).expand(self.world_size, -1))
            return []

        def _all_to_all(self, recv, send, recv_splits, send_splits):
            recv.copy_(torch.cat([torch.split(send, send_splits)[self.rank]] * self.world_size))

    loopback = Loopback(emulated=False)
    loopback.world_size = world_size
    return loopback


def _kernel_stacks(run) -> tuple[set, set]:
    """Every grpo_hf file `run()` enters, and the files on the stack at each encode / decode kernel call."""
    root = str(PACKAGE) + "/"
    entered, stacks = set(), set()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event != "call" or not name.startswith(root):
            return
        entered.add(name[len(root) :])
        if frame.f_code.co_name in ("encode_blocks", "decode_blocks"):
            files = []
            while frame is not None:
                if frame.f_code.co_filename.startswith(root) and frame.f_code.co_filename[len(root) :] not in files:
                    files.append(frame.f_code.co_filename[len(root) :])
                frame = frame.f_back
            stacks.add(tuple(reversed(files)))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entered, stacks


# The most files of grpo_hf on the stack when a sync's data reaches a kernel of `codec.py` from `end_step`.
SYNC_PATH_FILES = 5


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_sync_reaches_the_kernels_through_at_most_five_files(world_size):
    """
    The files between `OuterSyncState.end_step` and the encode / decode kernels, read off the stack at every kernel
    call of one sync (all-gathered at 2 ranks, reduced by owners from 3): `outer_sync.py` (the schedule) ->
    `fragment.py` (the fragment's Δ) -> `exchange.py` (the seam of the three transports) -> `codes/block.py` ->
    `codec.py`. Run with `-s`
    to see them and every file the sync enters.
    """
    import torch
    from torch import nn

    from grpo_hf.compression import CodecSpec
    from grpo_hf.compression.outer_sync import OuterSyncState

    model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 256))
    plan = {n: CodecSpec(bits=4) if p.dim() == 2 else None for n, p in model.named_parameters()}
    # W ranks that all moved alike (the collectives played by a loopback communicator)
    state = OuterSyncState(plan, [list(plan)], every=1, ramp=False, communicator=_loopback(world_size)).bind(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    entered, stacks = _kernel_stacks(state.end_step)
    assert state.totals()["syncs"] == 1 and stacks
    print(f"\nW={world_size}: " + "; ".join(" -> ".join(files) for files in sorted(stacks)))
    print("  entered: " + ", ".join(sorted(entered)))
    assert all(len(files) <= SYNC_PATH_FILES for files in stacks), stacks
    assert all(files[0] == "compression/outer_sync.py" and "compression/exchange.py" in files for files in stacks)


def test_fsdp2s_reduce_scatter_reaches_the_kernels_through_the_exchange():
    """FSDP2's compressed reduce-scatter (2 ranks, played by a loopback communicator): `fsdp.py` -> `exchange.py` ->
    `codes/block.py` (the code) -> `codec.py`."""
    import torch
    import torch.distributed as dist

    from grpo_hf.compression import fsdp

    state = fsdp.FSDPCommState(bits=8, compile_codec=False, communicator=_loopback(2))
    output, flat = torch.empty(256), torch.randn(512)
    _, stacks = _kernel_stacks(lambda: state.reduce_scatter("unit", output, flat, None, dist.ReduceOp.AVG))
    assert stacks and state.stats.bytes_sent > 0
    # (the kernels' functions are the block code's, compiled or run by codec.py: block.py -> codec.py -> block.py)
    path = ("compression/fsdp.py", "compression/exchange.py", "compression/codec.py", "compression/codes/block.py")
    assert all(files == path for files in stacks)


# --- the transports: built from the settings, then never asked which one they are ---

# What tells a transport apart: its class, its name in checkpoints.
TRANSPORTS = ("GRPOCommState", "FSDPCommState", "OuterSyncState", "CommState")
TRANSPORT_MODES = ("OUTER_MODE", "FSDP_MODE", "MODES", "outer-sync", "fsdp-reduce-scatter", "allgather", "allreduce")


def _names(node: ast.AST) -> set[str]:
    """The names, attributes and string constants in `node`."""
    found = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.add(child.value)
    return found


@pytest.mark.parametrize("module", [name for name in MODULES if not name.startswith("grpo_hf.compression")])
def test_no_code_outside_the_comm_states_chooses_a_transport_by_type(module):
    """
    The trainer, its callback, the checkpoints and the application talk to any transport through its protocol
    (`grpo_hf.compression.transport.CommState`): none asks which one it holds, by class (`isinstance`, `type`), by name
    in checkpoints (a `mode` compared), or by what it happens to have (`hasattr` / `getattr` with a default).
    """
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if call and node.func.id in ("isinstance", "issubclass", "type") and _names(node) & set(TRANSPORTS):
            found.append(ast.unparse(node))
        elif call and node.func.id in ("hasattr", "getattr") and len(node.args) > 1 and "comm_state" in _names(node):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Compare):  # a transport's mode (`comm_state.mode`, a saved state's "mode")
            operands = [node.left, *node.comparators]
            modes = any(
                isinstance(o, (ast.Attribute, ast.Subscript))
                and "mode" in _names(o)
                and any("comm" in n for n in _names(o))
                for o in operands
            )
            if modes or _names(node) & set(TRANSPORT_MODES):
                found.append(ast.unparse(node))
    assert not found, f"{module} chooses a transport by type: {found}"


@pytest.mark.parametrize("module", [name for name in MODULES if not name.startswith("grpo_hf.compression")])
def test_no_code_outside_compression_builds_a_transport(module):
    """
    Which transport a run gets is chosen in one place, `grpo_hf/compression/build.py` (`build_comm_state`: each
    transport's `from_settings` says whether it applies and owns its refusals); the trainer only asks. No module outside
    `grpo_hf.compression` calls a transport's class.
    """
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in TRANSPORTS:
                found.append(ast.unparse(node)[:80])
    assert not found, f"{module} builds a transport itself: {found}"


# --- the wire: one door ---

# What reaches other ranks, or asks about them, in `torch.distributed`: only a communicator calls these.
WIRE_CALLS = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "get_backend",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "irecv",
    "isend",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "split_group",
}
WIRE_MODULES = ("grpo_hf.compression.communicator", "grpo_hf.compression.torchft_group")
# Where else the package may call them, and why (each a place a communicator cannot be: it is being made there).
WIRE_EXCEPTIONS = {
    "grpo_hf.replica_groups": "the process mesh's construction (new_group, and the world it splits)",
    "grpo_hf.cli.main": "the command's teardown: destroy_process_group, after asking the backend",
}


@pytest.mark.parametrize("module", [name for name in MODULES if name not in WIRE_MODULES + tuple(WIRE_EXCEPTIONS)])
def test_no_module_but_the_communicators_touches_the_wire(module):
    """
    Every collective of the library and the application, and every question about the ranks (world size, rank,
    backend, a group's members, a new group), goes through a `Communicator` (`compression/communicator.py`, torchft's in
    `compression/torchft_group.py`): no other module calls `torch.distributed` for them, or imports them from it
    (except the named [`WIRE_EXCEPTIONS`]). A fault-tolerant communicator then replaces the wire in one place.
    """
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WIRE_CALLS:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed", "distributed"):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found.extend(f"from {node.module} import {a.name}" for a in node.names if a.name in WIRE_CALLS)
    assert not found, f"{module} reaches the wire around its communicator: {found}"
