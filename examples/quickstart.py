"""Train a small MLP with gefen.Gefen, checkpoint it, and resume.

    python examples/quickstart.py
"""

import io

import torch

import gefen


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 8)
    )


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(128, 32, generator=gen)
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(99))
    return x, torch.tanh(x @ teacher)


def train(model, opt, sched, steps, start=0):
    for step in range(start, start + steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return loss.item()


def main():
    model = make_model()
    opt = gefen.Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=400)
    print(f"loss after 200 steps: {train(model, opt, sched, 200):.4f}")

    buf = io.BytesIO()  # a file in real use
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, buf)
    state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values()
                      for k, t in st.items() if isinstance(t, torch.Tensor) and k != "codebook")
    n = sum(p.numel() for p in model.parameters())
    print(f"optimizer state: {state_bytes / n:.3f} bytes per parameter (AdamW: 8)")

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = make_model()
    resumed.load_state_dict(ckpt["model"])
    opt2 = gefen.Gefen(resumed.named_parameters(), lr=3e-3, weight_decay=0.01)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=400)
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])

    a = train(model, opt, sched, 200, start=200)
    b = train(resumed, opt2, sched2, 200, start=200)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
    print(f"loss after 400 steps: {a:.4f} (resumed run: {b:.4f}, bitwise identical: {same})")


if __name__ == "__main__":
    main()
