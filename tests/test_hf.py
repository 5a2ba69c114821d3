"""lrdsl.hf on the CPU (Triton's interpreter), tiny sizes: a causal LM of spec mixers through the Auto
classes; left padding equals the unpadded prompts; generate with the cache equals generate without;
save_pretrained then from_pretrained in a fresh process with only the saved folder (-m slow, with
training, gradient checkpointing, beam search and a hybrid with softmax attention); FLA checkpoints
loaded into the matching lrdsl layer, against FLA's own naive recurrences here and FLA's layers on
the GPU (-m gpu)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")  # the optional extra lrdsl[hf]

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import lrdsl  # noqa: E402
import lrdsl.hf  # noqa: E402
from lrdsl.hf import LrdslConfig, LrdslForCausalLM, load_fla_state_dict  # noqa: E402
from lrdsl.nn import Layer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GDN = ROOT / "examples" / "gated_deltanet.lr"
VOCAB, D = 48, 32


def rms_ratio(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def tiny(seed=0, **kw):
    """A two-block model of examples/gated_deltanet.lr through the Auto classes."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model("lrdsl", spec=str(GDN), vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2,
                                  num_heads=2, head_dim=16, intermediate_size=64, **kw)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny()


def test_config_carries_the_spec_text(tmp_path):
    text = GDN.read_text()
    assert LrdslConfig(spec=GDN).spec == text and LrdslConfig(spec=str(GDN)).spec == text
    assert LrdslConfig(spec=text).spec == text  # the text itself
    LrdslConfig(spec=GDN, hidden_size=D).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["spec"] == text
    assert AutoConfig.from_pretrained(tmp_path).spec == text
    with pytest.raises(lrdsl.SpecError, match="cannot read the spec"):
        LrdslConfig(spec=str(tmp_path / "missing.lr"))
    with pytest.raises(lrdsl.InputError, match="no spec"):
        LrdslForCausalLM(LrdslConfig())
    with pytest.raises(lrdsl.InputError, match="attn_layers"):
        LrdslConfig(spec=text, num_hidden_layers=2, attn_layers=[2])


def test_left_padding_equals_unpadded_prompts(model):
    """A left-padded batch (attention_mask) gives each prompt the logits it has alone, and the cache
    it returns goes on as each prompt's own cache does."""
    gen = torch.Generator().manual_seed(1)
    short, long = torch.randint(0, VOCAB, (1, 5), generator=gen), torch.randint(0, VOCAB, (1, 9), generator=gen)
    ids = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0] * 4 + [1] * 5, [1] * 9])
    nxt = torch.randint(0, VOCAB, (2, 1), generator=gen)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        step = model(nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                     past_key_values=out.past_key_values)
        for i, p in enumerate((short, long)):
            alone = model(p, use_cache=True)
            assert rms_ratio(out.logits[i, -p.shape[1]:], alone.logits[0]) < 1e-5, f"prompt {i}"
            alone_step = model(nxt[i:i + 1], past_key_values=alone.past_key_values)
            assert rms_ratio(step.logits[i], alone_step.logits[0]) < 1e-5, f"prompt {i}, next token"
        assert rms_ratio(out.logits[0, -5:], out.logits[1, -5:]) > 0.1  # two different prompts


def generate_both(model, ids, new=3, **kw):
    """Greedy tokens and logits with the recurrent cache and without (each step recomputes all)."""
    out = {}
    for use_cache in (True, False):
        r = model.generate(ids, max_new_tokens=new, do_sample=False, use_cache=use_cache, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0, **kw)
        out[use_cache] = (r.sequences, torch.stack(r.logits, 1))
    return out


def test_generate_with_the_cache_equals_without(model):
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = generate_both(model, ids)
    (seq, logits), (seq_nc, logits_nc) = out[True], out[False]
    assert torch.equal(seq, seq_nc), (seq.tolist(), seq_nc.tolist())
    assert rms_ratio(logits, logits_nc) < 1e-5
    assert not torch.equal(seq[0, 6:], seq[1, 6:]), "the continuations should depend on the prompt"


def test_a_recurrent_cache_is_not_cropped(model):
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
    assert cache.get_seq_length() == 3
    with pytest.raises(lrdsl.InputError, match="cannot be rolled back"):
        cache.crop(2)


FRESH = textwrap.dedent('''
    import sys, torch
    import lrdsl.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
        b = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False, pad_token_id=0)
    torch.save({"cache": a, "no_cache": b, "state": model.state_dict()}, sys.argv[3])
''')


@pytest.mark.slow  # CPU: about 60 s (training steps through the interpreter's kernels, a second process)
def test_auto_model_trains_saves_and_generates_in_a_fresh_process(tmp_path):
    """The issue's recipe: a two-block model from examples/gated_deltanet.lr through the Auto classes,
    a few training steps, save_pretrained, then from_pretrained in a fresh process that has only the
    saved folder, where greedy generation with the cache equals generation without it."""
    model = tiny(seed=3).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(4)
    batch = torch.randint(0, VOCAB, (2, 16), generator=gen)
    losses = []
    for _ in range(4):
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    model.eval().save_pretrained(tmp_path / "saved")
    (tmp_path / "work").mkdir()
    ids = torch.randint(0, VOCAB, (2, 6), generator=gen)
    torch.save(ids, tmp_path / "work" / "ids.pt")
    (tmp_path / "work" / "fresh.py").write_text(FRESH)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(ROOT)  # lrdsl itself, not the examples: the spec comes from the folder
    proc = subprocess.run([sys.executable, "fresh.py", str(tmp_path / "saved"), "ids.pt", "out.pt"],
                          cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "work" / "out.pt")
    want = model.state_dict()
    assert set(got["state"]) == set(want) and all(torch.equal(got["state"][n], want[n]) for n in want)
    assert torch.equal(got["cache"], got["no_cache"]), (got["cache"].tolist(), got["no_cache"].tolist())
    with torch.no_grad():
        here = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got["cache"], here)


@pytest.mark.slow  # CPU: about 25 s
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients():
    model = tiny(seed=5).train()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    calls = []
    model.model.layers[0].mixer.register_forward_hook(lambda *a: calls.append(1))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    assert len(calls) == 1
    model.gradient_checkpointing_enable()
    checkpointed = grads()
    assert len(calls) == 3, "a checkpointed block runs its forward again in the backward"
    for n, g in plain.items():
        assert rms_ratio(checkpointed[n], g) < 1e-5, n


@pytest.mark.slow  # CPU: about 30 s
def test_beam_search_reorders_the_cache(model):
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = {c: model.generate(ids, max_new_tokens=4, num_beams=3, do_sample=False, use_cache=c, pad_token_id=0)
               for c in (True, False)}
    assert torch.equal(out[True], out[False]), (out[True].tolist(), out[False].tolist())


@pytest.mark.slow  # CPU: about 40 s
def test_hybrid_with_softmax_attention():
    """Block 1 of 2 is softmax attention: left padding equals the unpadded prompt, and generation
    with the cache (recurrent states and attention keys) equals generation without."""
    model = tiny(seed=8, attn_layers=[1])
    assert type(model.model.layers[1].mixer).__name__ == "LrdslAttention"
    gen = torch.Generator().manual_seed(9)
    short, long = torch.randint(1, VOCAB, (1, 4), generator=gen), torch.randint(1, VOCAB, (1, 7), generator=gen)
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0] * 3 + [1] * 4, [1] * 7])
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        assert rms_ratio(padded[0, 3:], model(short).logits[0]) < 1e-5
        assert torch.isfinite(padded).all()
        out = generate_both(model, ids, attention_mask=mask)
        alone = model.generate(short, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out[True][0], out[False][0])
    assert torch.equal(out[True][0][0, 7:], alone[0, 4:7]), "the padded prompt generates what it does alone"


# ---- FLA checkpoints -------------------------------------------------------------------------------
# FLA's layers run only on a GPU (their Triton kernels have no CPU path); here the oracle is FLA's layer
# forward written out from fla/layers/*.py over FLA's own naive recurrences (fla.ops.*.naive, pure torch).

def fla_weights(kind, H, K, V, gen, conv=True):
    """Random weights with the names and shapes of FLA's layer state_dicts (num_v_heads = num_heads)."""
    r = lambda *s: 0.3 * torch.randn(*s, generator=gen)  # noqa: E731
    sd = {"q_proj.weight": r(H * K, D), "k_proj.weight": r(H * K, D), "v_proj.weight": r(H * V, D),
          "g_proj.weight": r(H * V, D), "o_proj.weight": r(D, H * V)}
    if conv:
        sd.update({f"{n}_conv1d.weight": r(H * (V if n == "v" else K), 1, 4) for n in "qkv"})
    if kind == "gated_deltanet":
        sd.update({"a_proj.weight": r(H, D), "b_proj.weight": r(H, D), "A_log": torch.rand(H, generator=gen) + 0.5,
                   "dt_bias": r(H), "o_norm.weight": 1 + r(V)})
    elif kind == "gla":
        sd.update({"gk_proj.0.weight": r(16, D), "gk_proj.1.weight": r(H * K, 16), "gk_proj.1.bias": r(H * K),
                   "g_norm_swish_gate.weight": 1 + r(V)})
    else:
        del sd["g_proj.weight"]
        sd.update({"f_proj.0.weight": r(V, D), "f_proj.1.weight": r(H * K, V), "b_proj.weight": r(H, D),
                   "A_log": torch.rand(H, generator=gen) + 0.5, "dt_bias": r(H * K), "g_proj.0.weight": r(V, D),
                   "g_proj.1.weight": r(H * V, V), "g_proj.1.bias": r(H * V), "o_norm.weight": 1 + r(V)})
    return sd


def fla_forward(kind, sd, x, H, K, V):
    """FLA's layer forward (fla/layers/gated_deltanet.py, gla.py, kda.py at fla 0.6.0), step by step."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.kda.naive import naive_recurrent_kda
    B, T, _ = x.shape
    lin = lambda name: x @ sd[name].T  # noqa: E731

    def conv(n, h):  # ShortConvolution: causal depthwise, SiLU
        return F.silu(F.conv1d(F.pad(h.transpose(1, 2), (3, 0)), sd[f"{n}_conv1d.weight"], groups=h.shape[-1])
                      ).transpose(1, 2)

    heads = lambda t, d: t.reshape(B, T, H, d)  # noqa: E731
    l2 = lambda t: t / (t.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    if kind == "gla":
        q, k, v = heads(lin("q_proj.weight"), K), heads(lin("k_proj.weight"), K), heads(lin("v_proj.weight"), V)
        gk = F.logsigmoid(lin("gk_proj.0.weight") @ sd["gk_proj.1.weight"].T + sd["gk_proj.1.bias"]) / 16
        o, _ = naive_recurrent_gla(q, k, v, heads(gk, K))
        w, gate = sd["g_norm_swish_gate.weight"], F.silu(lin("g_proj.weight"))
    else:
        q, k, v = (conv(n, lin(f"{n}_proj.weight")) for n in "qkv")
        q, k, v = l2(heads(q, K)), l2(heads(k, K)), heads(v, V)
        beta = torch.sigmoid(lin("b_proj.weight"))
        if kind == "gated_deltanet":
            g = -sd["A_log"].exp() * F.softplus(lin("a_proj.weight") + sd["dt_bias"])
            o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g)
            gate = F.silu(lin("g_proj.weight"))
        else:
            f = lin("f_proj.0.weight") @ sd["f_proj.1.weight"].T
            g = -sd["A_log"].exp()[:, None] * F.softplus(heads(f, K) + sd["dt_bias"].view(H, K))
            o, _ = naive_recurrent_kda(q, k, v, g, beta)
            gate = torch.sigmoid(lin("g_proj.0.weight") @ sd["g_proj.1.weight"].T + sd["g_proj.1.bias"])
        w = sd["o_norm.weight"]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w * heads(gate, V)
    return o.reshape(B, T, H * V) @ sd["o_proj.weight"].T


LAYOUTS = {"gated_deltanet": {}, "gla": {"use_short_conv": False},
           "kda": {"output_gate": "sigmoid", "output_gate_bias": True}}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_fla_weights_give_fla_outputs(compiled, kind):
    H, K, V = 2, 16, 32
    gen = torch.Generator().manual_seed(10)
    sd = fla_weights(kind, H, K, V, gen, conv=kind != "gla")
    layer = Layer(compiled(ROOT / "examples" / f"{kind}.lr"), D, H, K, head_v_dim=V, **LAYOUTS[kind])
    load_fla_state_dict(layer, sd)
    x = torch.randn(2, 20, D, generator=gen)
    with torch.no_grad():
        err = rms_ratio(layer(x)[0], fla_forward(kind, sd, x, H, K, V))
    assert err < 1e-5, f"{kind}: rms ratio {err:.3g}"


def test_fla_weights_that_do_not_fit_are_one_clear_sentence(compiled):
    gen = torch.Generator().manual_seed(11)
    gdn = Layer(compiled(GDN), D, 2, 16)
    gla = Layer(compiled(ROOT / "examples" / "gla.lr"), D, 2, 16)  # with short convolutions
    cases = [
        (gla, fla_weights("gla", 2, 16, 16, gen, conv=False), "use_short_conv=False"),
        (gdn, {**fla_weights("gated_deltanet", 2, 16, 16, gen), "q_conv1d.bias": torch.zeros(32)}, "no bias"),
        (gdn, fla_weights("gated_deltanet", 2, 16, 32, gen), "head_v_dim"),
        (gdn, {"q_proj.weight": torch.zeros(32, D)}, "not of an FLA"),
    ]
    for layer, sd, words in cases:
        with pytest.raises(lrdsl.InputError) as e:
            load_fla_state_dict(layer, sd)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def _fla_layers():
    """FLA's layer classes (pip package flash-linear-attention). Its fla/__init__ imports fla.models,
    which needs transformers 5; the layers do not, so fla.models is left out where it cannot load."""
    try:
        import fla.models  # noqa: F401
    except ImportError:
        sys.modules.setdefault("fla.models", None)  # fla/__init__ then treats the models as absent
    layers = pytest.importorskip("fla.layers", reason="FLA's layers: pip install --no-deps flash-linear-attention")
    return layers


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_fla_layer_state_dict_on_the_gpu(kind):
    """FLA's layer (random init) and lrdsl's layer holding its state_dict: the same outputs in bf16."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    layers = _fla_layers()
    torch.manual_seed(0)
    H, K, V, hidden = 4, 64, 128, 256
    cls = {"gated_deltanet": layers.GatedDeltaNet, "gla": layers.GatedLinearAttention,
           "kda": layers.KimiDeltaAttention}[kind]
    kw = dict(hidden_size=hidden, num_heads=H, mode="chunk")
    kw.update({"gated_deltanet": dict(head_dim=K, expand_v=V / K), "kda": dict(head_dim=K, expand_v=V / K),
               "gla": dict(expand_k=H * K / hidden, expand_v=H * V / hidden)}[kind])
    theirs = cls(**kw).cuda()
    ours = Layer(ROOT / "examples" / f"{kind}.lr", hidden, H, K, head_v_dim=V, **LAYOUTS[kind]).cuda()
    load_fla_state_dict(ours, theirs.state_dict())
    x = torch.randn(2, 300, hidden, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = theirs(x)[0], ours(x)[0]
    err = rms_ratio(got.float(), want.float())
    assert err < 2e-2, f"{kind}: rms ratio {err:.3g} (bf16: about 5e-3 expected)"
