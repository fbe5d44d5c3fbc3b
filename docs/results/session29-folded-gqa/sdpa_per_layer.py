import time, torch
import torch.nn.functional as F
torch.manual_seed(0)
def rep(x, n):
    b, h, l, d = x.shape
    return x[:, :, None].expand(b, h, n, l, d).reshape(b, h * n, l, d)
def bench(fn, n=300):
    for _ in range(20): fn()
    t = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t) / n * 1e3
for B, N, L in [(1, 1, 400), (1, 8, 400), (4, 3, 400), (8, 2, 400), (16, 1, 400), (4, 3, 800)]:
    q = torch.randn(B, N, 9, 64).transpose(1, 2)
    buf = torch.randn(B, 3, L + 256, 64); k = buf[:, :, :L]; v = torch.randn(B, 3, L + 256, 64)[:, :, :L]
    mask = torch.zeros(B, 1, N, L); mask[..., -N:] = torch.triu(torch.full((N, N), torch.finfo(torch.float32).min), 1)
    a = lambda: F.scaled_dot_product_attention(q, rep(k, 3), rep(v, 3), attn_mask=mask)
    b = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    def c():
        qp = q.reshape(B, 3, 3 * N, 64)
        mp = mask.repeat(1, 1, 3, 1)
        return F.scaled_dot_product_attention(qp, k, v, attn_mask=mp).view(B, 9, N, 64)
    ref = a()
    assert torch.allclose(ref, b(), atol=1e-5) and torch.allclose(ref, c(), atol=1e-5)
    print(f"B={B} N={N} L={L}: repeat_kv {bench(a):.3f} ms, enable_gqa {bench(b):.3f} ms, packed {bench(c):.3f} ms", flush=True)
