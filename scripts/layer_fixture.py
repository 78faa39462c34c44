"""What the layer fixture scripts share (make_hybrid_layer_fixture.py, make_moe_family_fixture.py):
the sequences' shape, bf16 rounding, the routing margin a draw must clear, one layer's forward and
autograd backward, and the file they write. Imported by them; not run alone."""
import torch
import transformers
from safetensors.torch import save_file

B, S = 2, 9  # sequences, tokens each


def bf16(t):
    return t.to(torch.bfloat16).to(torch.float32)


def causal_mask():
    """Eager attention's additive causal mask for B sequences of S tokens."""
    return torch.full((S, S), float("-inf")).triu(1).expand(B, 1, S, S)


def routing_margin(layer, h):
    """The smallest gap between a token's k-th and (k+1)-th routing probability."""
    with torch.no_grad():
        n2 = layer.post_attention_layernorm(h).reshape(-1, h.shape[-1])
        probs = torch.softmax(n2 @ layer.mlp.gate.weight.T, dim=-1, dtype=torch.float)
        top = torch.topk(probs, layer.mlp.gate.top_k + 1, dim=-1).values
        return float((top[:, -2] - top[:, -1]).min())


def forward_backward(layer, x, dy, **kwargs):
    """y = layer(x) and the gradients of sum(y * dy): (y, dx, {parameter name: gradient})."""
    x = x.detach().requires_grad_(True)
    params = dict(layer.named_parameters())
    y = layer(x, **kwargs)
    y = y[0] if isinstance(y, tuple) else y
    grads = torch.autograd.grad((y * dy).sum(), [x, *params.values()])
    return y.detach(), grads[0], dict(zip(params.keys(), grads[1:]))


def entries(family, idx, out):
    """The fixture's tensors of one layer, named F.L.<what>: weights (w.*) as bf16, the rest fp32."""
    return {f"{family}.{idx}.{k}": (v.to(torch.bfloat16) if k.startswith("w.") else v).contiguous() for k, v in out.items()}


def save(tensors, path):
    save_file(tensors, path, metadata={"torch": torch.__version__, "transformers": transformers.__version__,
                                       "sequences": str(B), "tokens": str(S)})
    print(f"wrote {len(tensors)} tensors to {path} (torch {torch.__version__}, transformers {transformers.__version__})")
