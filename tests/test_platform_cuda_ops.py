"""The CUDA platform's Triton element-wise kernels (``platform.triton_ops``), against the
reference ops on small shapes, in float32 and bfloat16: on the GPU where one is visible, else on
the CPU under Triton's interpreter (slow: the shapes stay small)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before triton is first imported: its library functions are made then.
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="the kernels need the 'triton' package")

from corellm.ops import REFERENCE_OPS  # noqa: E402
from corellm_plugins.platform_cuda.ops import TRITON_OPS  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _kernels_can_run():
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(triton.language.standard.zeros, InterpretedFunction):
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")


def _tol(dtype):
    # float32: rounding only. bfloat16: the kernels round once where the reference rounds after
    # each step, and Triton's interpreter rounds float32 to bfloat16 toward zero where a GPU
    # rounds to nearest: two units in the last place (2^-7 relative) apart at most.
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2,
                                                                        "atol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 48)])      # 48: a partial tile, masked
def test_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    got = TRITON_OPS.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, REFERENCE_OPS.rms_norm(x, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 48, generator=g).to(dtype).to(DEVICE)
    r = (4 * torch.randn(2, 3, 48, generator=g)).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype).to(DEVICE)
    x0, r0 = x.clone(), r.clone()
    normed, summed = TRITON_OPS.add_rms_norm(x, r, w, 1e-6)
    want_normed, want_summed = REFERENCE_OPS.add_rms_norm(x, r, w, 1e-6)
    if dtype == torch.float32 or DEVICE.type == "cuda":  # the interpreter rounds bf16 down
        assert torch.equal(summed, want_summed)          # the sum rounds as the reference's
    torch.testing.assert_close(summed, want_summed, **_tol(dtype))
    torch.testing.assert_close(normed, want_normed, **_tol(dtype))
    assert torch.equal(x, x0) and torch.equal(r, r0)     # the inputs are left as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_normed(dtype):
    """Qwen3's per-head RMSNorms then RoPE in one kernel, on q and k that are views into a
    fused QKV output (rows strided), as the model passes them."""
    g = torch.Generator().manual_seed(4)
    d, heads, kv_heads, eps = 32, 3, 2, 1e-6
    positions = torch.tensor([0, 5, 2], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(8).float()[:, None] * inv[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(DEVICE)
    wq = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
    wk = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)

    def views(t):
        q, k, _ = t.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        return q.view(3, heads, d), k.view(3, kv_heads, d)
    q, k = views(qkv.clone())
    want_q, want_k = REFERENCE_OPS.rotary(positions, REFERENCE_OPS.rms_norm(q, wq, eps),
                                          REFERENCE_OPS.rms_norm(k, wk, eps), cos, sin, d)
    assert REFERENCE_OPS.rotary_normed(positions, q, k, wq, wk, eps, cos, sin, d) is None
    got_q, got_k = TRITON_OPS.rotary_normed(positions, q, k, wq, wk, eps, cos, sin, d)
    assert got_q is q and got_k is k
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))
    # Partial rotary embeddings are not fused (the layer runs the norms and RoPE instead).
    assert TRITON_OPS.rotary_normed(positions, q, k, wq, wk, eps, cos[:, :8], sin[:, :8],
                                    16) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(2, 3, 2 * 40, generator=g)).to(dtype).to(DEVICE)
    got = TRITON_OPS.silu_and_mul(x)
    assert got.shape == (2, 3, 40) and got.dtype == dtype
    torch.testing.assert_close(got, REFERENCE_OPS.silu_and_mul(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (64, 32)])   # whole and partial
def test_rotary(dtype, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 7, 3, 30], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.arange(32).float()[:, None] * inv[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    q = torch.randn(4, 3, head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(4, 2, head_dim, generator=g).to(dtype).to(DEVICE)
    want_q, want_k = REFERENCE_OPS.rotary(positions, q.clone(), k.clone(), cos, sin, rotary_dim)
    got_q, got_k = TRITON_OPS.rotary(positions, q, k, cos, sin, rotary_dim)
    assert got_q is q and got_k is k                    # in place, as the interface allows
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))


def test_what_the_kernels_do_not_take_falls_back_to_the_reference():
    x = torch.randn(4, 64, device=DEVICE)
    strided = x.t()                                      # last dimension not contiguous
    w = torch.ones(4, device=DEVICE)
    torch.testing.assert_close(TRITON_OPS.rms_norm(strided, w, 1e-6),
                               REFERENCE_OPS.rms_norm(strided, w, 1e-6))
    odd = torch.randn(3, 5, device=DEVICE)               # no even split into gate | up
    with pytest.raises(Exception):
        REFERENCE_OPS.silu_and_mul(odd) + 0              # the reference's own answer
    assert TRITON_OPS.silu_and_mul(torch.randn(0, 8, device=DEVICE)).shape == (0, 4)


def test_the_cuda_platform_gives_the_kernels_with_triton_ops():
    from corellm_plugins.platform_cuda import CudaOptions
    from corellm_plugins.platform_cuda.platform import CudaPlatform
    assert CudaPlatform(CudaOptions(triton_ops=True)).ops is TRITON_OPS
    assert CudaPlatform(CudaOptions()).ops is REFERENCE_OPS


class _Counted(type(TRITON_OPS)):
    """The Triton ops, counting the calls that reach a kernel."""

    calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def rms_norm(self, x, weight, eps):
        self._count("rms_norm")
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        self._count("add_rms_norm")
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary_normed(self, *args):
        out = super().rotary_normed(*args)
        if out is not None:
            self._count("rotary_normed")
        return out

    def silu_and_mul(self, x):
        self._count("silu_and_mul")
        return super().silu_and_mul(x)

    def rotary(self, positions, q, k, cos, sin, rotary_dim):
        self._count("rotary")
        return super().rotary(positions, q, k, cos, sin, rotary_dim)


COUNTED = _Counted()


class _TritonOnHost:
    """A platform for this test: the host, with the Triton ops (under the interpreter there)."""

    def corellm_platforms(self):
        from corellm.components import PlatformSpec
        from corellm.platforms import Platform, host_memory_available

        class TritonHost(Platform):
            device_type = "cpu"

            def device(self, local_rank=0):
                return torch.device("cpu")

            def free_memory(self, device, local_world_size=1):
                return host_memory_available() // local_world_size

            @property
            def ops(self):
                return COUNTED

        yield PlatformSpec(name="triton_host", factory=TritonHost)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the host run of the interpreter")
@pytest.mark.parametrize("arch, kernels", [
    ("llama", {"rms_norm", "add_rms_norm", "silu_and_mul", "rotary"}),
    ("qwen3", {"rms_norm", "add_rms_norm", "silu_and_mul", "rotary_normed"}),
])
def test_a_model_on_the_kernels_generates_what_the_reference_does(make_checkpoint, monkeypatch,
                                                                  arch, kernels):
    """Every RMSNorm (the residual's add fused with it after the first layer's), SiLU-and-
    multiply and RoPE (Qwen3: with its q/k norms) of a model through the kernels, none falling
    back to the reference: the greedy tokens are the CPU platform's (float32)."""
    import corellm.ops
    from corellm import LLM, SamplingParams
    from tests.conftest import engine_config

    path = make_checkpoint(arch)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 13, 2, 40]}, {"prompt_token_ids": [7, 3]}]

    def run(platform, plugins=()):
        with LLM(engine_config(path, platform={"name": platform}),
                 plugins=list(plugins)) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy,
                                                                 use_tqdm=False)]
    want = run("cpu")
    fallbacks = []
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary"):
        monkeypatch.setattr(corellm.ops.DeviceOps, name,
                            lambda self, *args, _name=name: fallbacks.append(_name))
    COUNTED.calls.clear()
    assert run("triton_host", [_TritonOnHost()]) == want
    assert set(COUNTED.calls) == kernels, COUNTED.calls
    assert not fallbacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear(dtype):
    """The multi-LoRA kernels against the reference: tokens of two adapters and of the base
    model (slot -1) interleaved, a QKV-like layer of three parts (one block of columns partial),
    a rank below the slots' width (masked), the base model's rows untouched."""
    from types import SimpleNamespace

    from corellm.lora.model import LoRABatch
    g = torch.Generator().manual_seed(3)
    slots_n, rank, k, spans = 3, 6, 40, [(0, 24), (24, 8), (32, 8)]
    a = (torch.randn(slots_n, 3, rank, k, generator=g) * 0.3).to(dtype).to(DEVICE)
    b = [(torch.randn(slots_n, rank, n, generator=g) * 0.3).to(dtype).to(DEVICE)
         for _, n in spans]
    batch = LoRABatch()
    slots = torch.tensor([0, -1, 2, 2, 0, -1, 1], device=DEVICE)
    batch.slots = slots
    for s in (0, 1, 2):
        batch.groups.append((s, (slots == s).nonzero().flatten()))
    lora = SimpleNamespace(a=a, b=b, spans=spans, batch=batch, kernel=None)
    x = torch.randn(7, k, generator=g).to(dtype).to(DEVICE)
    y0 = torch.randn(7, 40, generator=g).to(dtype).to(DEVICE)
    want = REFERENCE_OPS.lora_linear(y0.float().clone(), x.float(),
                                     SimpleNamespace(a=a.float(), b=[t.float() for t in b],
                                                     spans=spans, batch=batch))
    got = TRITON_OPS.lora_linear(y0.clone(), x, lora)
    torch.testing.assert_close(got.float(), want, **_tol(dtype))
    base = slots < 0
    assert torch.equal(got[base], y0[base])
