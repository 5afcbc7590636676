"""Fault-tolerant replica groups on three machines: network namespaces, each with its own address and loopback.

On one machine every group reaches the others at 127.0.0.1, which hides what a cluster needs: that each group is
advertised at an address the other machines reach (its manager, store, checkpoint server and gloo's connections). Here
three network namespaces on a bridge stand for three machines (root and iproute2 needed: skipped otherwise), and
docs/engines.md's three-machine lines run as printed, one machine each, the lighthouse beside group 0.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.slow, pytest.mark.peers]

DOCS = Path(__file__).resolve().parents[1] / "docs" / "engines.md"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def machines():
    """Three namespaces on a bridge of their own; yields `(names, addresses)`, removed afterwards."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"g{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250}"
    names, addresses = [f"{tag}m{i}" for i in range(3)], [f"{subnet}.{10 + i}" for i in range(3)]
    bridge = f"{tag}br"
    if _ip("link", "add", bridge, "type", "bridge", check=False).returncode:
        pytest.skip("cannot create a bridge here")
    try:
        _ip("link", "set", bridge, "up")
        for i, (name, address) in enumerate(zip(names, addresses)):
            _ip("netns", "add", name)
            _ip("link", "add", f"{tag}v{i}", "type", "veth", "peer", "name", f"{tag}h{i}")
            _ip("link", "set", f"{tag}v{i}", "netns", name)
            _ip("link", "set", f"{tag}h{i}", "master", bridge)
            _ip("link", "set", f"{tag}h{i}", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", f"{tag}v{i}")
            _ip("-n", name, "link", "set", f"{tag}v{i}", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names, addresses
    finally:
        for i, name in enumerate(names):
            _ip("netns", "del", name, check=False)
            _ip("link", "del", f"{tag}h{i}", check=False)
        _ip("link", "del", bridge, check=False)


def test_the_documented_three_machine_launch_runs_as_printed(machines, tmp_path):
    # each machine's line in its own namespace and folder; the groups reach each other only through the bridge (their
    # 127.0.0.1 is their own), and end with the same model
    pytest.importorskip("torchft")
    names, addresses = machines
    text = DOCS.read_text()
    section = text[text.index("Three machines, one replica group each, on CPUs") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) == 4 and lines[0].startswith("torchft_lighthouse ")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RUST_LOG": "error"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    commands = [line.replace("10.0.0.1", addresses[0]) for line in lines]
    folders = [tmp_path / f"machine-{i}" for i in range(3)]
    for folder in folders:
        folder.mkdir()
    lighthouse = subprocess.Popen(["ip", "netns", "exec", names[0], "bash", "-c", commands[0].rstrip(" &")],
                                  cwd=folders[0], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    logs = [open(folder / "group.log", "w") for folder in folders]
    try:
        groups = [
            subprocess.Popen(
                ["ip", "netns", "exec", name, "bash", "-c", command],
                cwd=folder,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for name, command, folder, log in zip(names, commands[1:], folders, logs)
        ]
        codes = [group.wait(timeout=600) for group in groups]
    finally:
        lighthouse.kill()
        for log in logs:
            log.close()
    output = "\n".join(f"--- machine {i}\n{(f / 'group.log').read_text()[-3000:]}" for i, f in enumerate(folders))
    assert codes == [0, 0, 0], output
    models = [(folder / "runs/ft-tiny/model.safetensors").read_bytes() for folder in folders]
    assert models[0] == models[1] == models[2]
