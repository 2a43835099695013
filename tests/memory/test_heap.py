"""``device.cpu_keep_freed_memory``: glibc serves large blocks from the heap and keeps them.

Each case runs in a fresh Python process (the malloc settings are the whole process's), builds an
Engine on the tiny model and then allocates and frees a 64 MiB tensor, as a forward frees its big
activations. glibc's own counters (``mallinfo2``) say where the block lived: in its own mapping
(``hblkhd``), the default, or in the heap, kept there after the free (``fordblks``) and reused
without page faults. The default (``null``) must leave a caller's process alone unless plugserve
runs it (``claim_process``: the CLI, scheduler processes, tensor-parallel ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.memory.heap import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"),
                                reason="needs glibc >= 2.33 (mallopt and mallinfo2)")

CHILD = r"""
import ctypes, json, resource, sys
import torch
from framework import Engine
from framework.memory import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = heap._glibc()
libc.mallinfo2.restype = MallInfo2
model, setting, claim = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if claim:
    heap.claim_process()
engine = Engine(overrides=[f"model.path={model}", "kv_cache.max_total_tokens=256",
                           f"device.cpu_keep_freed_memory={setting}"], progress=False)
assert engine.generate([[1, 2, 3]], {"max_new_tokens": 2})[0]["output_ids"]
MIB = 2**20
before = libc.mallinfo2()
block = torch.ones(64 * MIB // 4)
during = libc.mallinfo2()
del block
after = libc.mallinfo2()
def reuse():
    block = torch.ones(64 * MIB // 4)
    del block

# The first reuses may not fit the freed block (an aligned request is a little larger, and small
# objects allocated meanwhile can sit above it): a second one is made. Then steps stop growing it.
reuse(); reuse()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):  # what the next steps pay for the same activation
    reuse()
print(json.dumps({"mapped_during_mib": (during.hblkhd - before.hblkhd) / MIB,
                  "heap_free_after_mib": after.fordblks / MIB,
                  "faults_per_reuse": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 5}))
"""


def run_child(model: Path, setting: str, claim: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), setting, "1" if claim else "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kept_blocks_come_from_the_heap_and_are_reused_without_faults(tiny_model: Path) -> None:
    kept = run_child(tiny_model, "true", claim=False)
    assert kept["mapped_during_mib"] == 0, kept
    assert kept["heap_free_after_mib"] >= 64, kept
    # 64 MiB is 16384 small pages; reusing the kept block touches none of them anew
    assert kept["faults_per_reuse"] < 100, kept


def test_glibc_defaults_map_each_large_block(tiny_model: Path) -> None:
    default = run_child(tiny_model, "false", claim=False)
    assert default["mapped_during_mib"] >= 64, default
    assert default["heap_free_after_mib"] < 64, default


def test_auto_applies_only_in_a_process_plugserve_runs(tiny_model: Path) -> None:
    embedded = run_child(tiny_model, "null", claim=False)
    assert embedded["mapped_during_mib"] >= 64, embedded
    owned = run_child(tiny_model, "null", claim=True)
    assert owned["mapped_during_mib"] == 0, owned
    assert owned["faults_per_reuse"] < 100, owned


RELEASE_CHILD = r"""
import json, sys
import torch
from framework.memory import heap
from framework.plugins import get_registry

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

heap.keep_freed_blocks()
comp = get_registry().get("memory_saver", "cpu")
saver = comp.factory(comp.make_options(None))
weights = [torch.randn(1024, 1024) for _ in range(16)]  # 64 MiB, from the heap now
kv = [torch.zeros(4096, 1024)]  # 16 MiB
saver.track("weights", weights, keep_contents=True)
saver.track("kv_cache", kv, keep_contents=False)
drops = []
for _ in range(2):  # the second time the resumed storages are heap blocks too
    before = rss()
    saver.pause("weights")
    saver.pause("kv_cache")
    drops.append((before - rss()) / 2**20)
    saver.resume("weights")
    saver.resume("kv_cache")
    kv[0].fill_(1.0)  # touch the KV as a forward would
saver.close()
print(json.dumps({"drops_mib": drops}))
"""


def test_a_memory_release_still_returns_kept_blocks() -> None:
    proc = subprocess.run([sys.executable, "-c", RELEASE_CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    drops = json.loads(proc.stdout.strip().splitlines()[-1])["drops_mib"]
    assert all(d >= 80 * 0.98 for d in drops), drops
