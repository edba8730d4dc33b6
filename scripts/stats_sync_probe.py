"""One GPU, no gpufeed: ResNet-50 bf16 training steps with the input normalised by statistics made anew each step
(``torch.tensor(list, device="cuda")``: a copy from pageable host memory, which waits for the stream's queued
work) against statistics made once, alternating windows in one process. What the loader's ``normalise`` cost
each step before its statistics were cached per device.

    device run (any GPU kind):  python3 scripts/stats_sync_probe.py [SECONDS]
"""
import sys
import time

MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)


def main() -> None:
    import torch
    import torchvision

    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    dev = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().to(dev, memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randint(0, 255, (256, 224, 224, 3), dtype=torch.uint8, device=dev)
    y = torch.randint(0, 1000, (256,), device=dev)
    cached = (torch.tensor(MEAN, device=dev).view(1, 3, 1, 1), torch.tensor(STD, device=dev).view(1, 3, 1, 1))

    def step(fresh: bool) -> None:
        mean, std = ((torch.tensor(MEAN, device=dev).view(1, 3, 1, 1), torch.tensor(STD, device=dev).view(1, 3, 1, 1))
                     if fresh else cached)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x.permute(0, 3, 1, 2).float().sub_(mean).div_(std)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(10):
        step(False)
    torch.cuda.synchronize()
    for fresh in (True, False, True, False):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step(fresh)
            n += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        print(f"{'fresh statistics each step' if fresh else 'statistics made once':28s} {n} steps "
              f"{wall / n * 1e3:6.2f} ms/step {n * 256 / wall:8.1f} img/s  ({torch.cuda.get_device_name(dev)})",
              flush=True)


if __name__ == "__main__":
    main()
