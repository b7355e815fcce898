"""A generated data set: 3 classes of small RGB images (a red square, a green disc, a blue bar).

Position, size, brightness and background noise vary, so the model has to look; the same seed
always gives the same images, on every rank.
"""

import torch

CLASSES = ("red square", "green disc", "blue bar")


def make_images(count: int, seed: int, size: int = 32, balanced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images ``[count, 3, size, size]`` in [0, 1] and their labels ``[count]``.

    ``balanced``: the classes take turns (for a small test set) instead of being drawn at random.
    """
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 3, size, size, generator=g) * 0.3  # noisy background
    labels = torch.randint(0, len(CLASSES), (count,), generator=g)
    if balanced:
        labels = torch.arange(count) % len(CLASSES)
    ys, xs = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i, label in enumerate(labels.tolist()):
        r = int(torch.randint(size // 8, size // 4, (1,), generator=g))
        cy, cx = (int(v) for v in torch.randint(r, size - r, (2,), generator=g))
        if label == 0:
            mask = ((ys - cy).abs() <= r) & ((xs - cx).abs() <= r)
        elif label == 1:
            mask = (ys - cy) ** 2 + (xs - cx) ** 2 <= r * r
        else:
            mask = ((ys - cy).abs() <= r // 3) & ((xs - cx).abs() <= 2 * r)
        brightness = 0.6 + 0.4 * float(torch.rand(1, generator=g))
        images[i, label][mask] = brightness
    return images, labels
