"""The images `make images` built, run by containerd and runc (`ctr run`) the way a node runs them:
the operator image as uid 10001 on a read-only root; the CPU trainer image importing its stack and
making the offline tiny model. Containers get a network namespace with loopback only.

Needs root, containerd and the images loaded (`make images`); a missing one fails naming it.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import build_images as build
import containerd_runtime as runtime
import image_recipe as recipe
import pytest

pytestmark = pytest.mark.images


@pytest.fixture(scope="module")
def rt() -> Iterator[runtime.Runtime]:
    for tool in ("containerd", "ctr", "runc"):
        if not shutil.which(tool):
            pytest.fail(
                f"{tool} is missing: `make images` installs Debian's containerd and runc", pytrace=False
            )
    rt = runtime.Runtime(build.runtime_home())
    _, started = runtime.start(rt, recipe.pause_ref(build.PAUSE_SOURCE.read_bytes()))
    yield rt
    if started:
        runtime.stop(rt)


def ref(rt: runtime.Runtime, name: str) -> str:
    spec = recipe.image_specs()[name]
    wanted = recipe.image_ref(spec, recipe.image_hash(spec, recipe.base_ref()))
    if wanted not in runtime.image_refs(rt):
        pytest.fail(f"{wanted} is not loaded in containerd ({rt.socket}): run `make images`", pytrace=False)
    return wanted


def ctr_run(
    rt: runtime.Runtime, image: str, *command: str, read_only: bool = False, timeout: float = 600
) -> str:
    """Runs one command in a new container (removed afterwards); returns its output, fails on non-zero."""
    name = f"rlhf-test-{uuid.uuid4().hex[:8]}"
    args = ["run", "--rm", *(["--read-only"] if read_only else []), image, name, *command]
    proc = runtime.ctr(rt, *args, timeout=timeout)
    assert proc.returncode == 0, (
        f"ctr {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


PROBE = """
import os, socket
print("uid", os.getuid(), os.getgid())
print("interfaces", sorted(name for _, name in socket.if_nameindex()))
try:
    open("/probe", "w")
    print("root writable")
except OSError as e:
    print("root", "read-only" if e.errno == 30 else e)
"""


def test_operator_image_runs_as_10001_on_a_read_only_root(rt: runtime.Runtime) -> None:
    image = ref(rt, "operator")
    out = ctr_run(
        rt,
        image,
        "python3",
        "-c",
        PROBE + "import rlhf_operator, kopf, kubernetes; print('imports ok')",
        read_only=True,
    )
    assert "uid 10001 10001" in out, out
    assert "root read-only" in out, out
    assert "interfaces ['lo']" in out, f"the container should have loopback only:\n{out}"
    assert "imports ok" in out
    crd = ctr_run(rt, image, "rlhf", "crd", read_only=True)
    assert "kind: CustomResourceDefinition" in crd and "rlhfjobs.rlhf.dev" in crd


TRAINER_CHECK = """
import torch, vllm, deepspeed, ray, rlhf_trainer, transformers
print("versions", torch.__version__, vllm.__version__, deepspeed.__version__, ray.__version__)
model = transformers.AutoModelForCausalLM.from_pretrained("/tmp/tiny/model")
tok = transformers.AutoTokenizer.from_pretrained("/tmp/tiny/model")
ids = tok("hello world", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=4, do_sample=False)
print("generated", out.shape[1] - ids.shape[1], "tokens with", sum(p.numel() for p in model.parameters()), "parameters")
"""


def test_trainer_image_imports_its_stack_and_makes_the_tiny_model_offline(rt: runtime.Runtime) -> None:
    image = ref(rt, "trainer")
    script = f"rlhf make-tiny-model /tmp/tiny --prompts 8 && ls /tmp/tiny && python -c '{TRAINER_CHECK}'"
    out = ctr_run(rt, image, "bash", "-c", script, timeout=900)
    assert "model" in out and "prompts.jsonl" in out, out
    assert "versions 2.13.0" in out and " 0.32.0 " in out, out
    assert "generated 4 tokens" in out, out
    probe = ctr_run(rt, image, "python", "-c", PROBE)
    assert "uid 10001 10001" in probe and "interfaces ['lo']" in probe, probe
