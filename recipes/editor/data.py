"""What the editor trains on: random crops of the training pictures, synthetic dead-leaves pictures (the VAE), and
edits drawn from a pool of encoded crops (the DiT). Every random choice comes from one CPU generator, so a
checkpoint's copy of that generator's state is the data position."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ditrun.editor import transforms
from ditrun.model.latents import pack
from recipes.editor import pictures

EMPTY_PROMPT = ""
# Dead leaves: radii from 1/64 of the side up to half of it, with density r^-3 (scale-invariant, as natural
# pictures are); enough discs to cover about four fifths of the picture over a background colour.
LEAF_RADII = (1 / 64, 1 / 2)
LEAVES = 300
PALETTE = 65536


class Crops:
    """Random square crops of the training pictures, resized to a given size, on ``device``.

    Scales (a crop's side is 30-100% of the picture's shorter side), flips, a random order of the colour
    channels for colour pictures and a random tint for grey ones (but for a fraction ``untinted`` of them, left
    grey); every choice is drawn from ``gen``, and with ``untinted`` 0 no draw is added for it.
    """

    def __init__(self, names, device: torch.device, gen: torch.Generator, untinted: float = 0.0):
        loaded = [pictures.load(n) for n in names]
        self.pictures = [torch.from_numpy(p).permute(2, 0, 1).to(device) for p in loaded]
        self.grey = [pictures.is_grey(p) for p in loaded]
        self.gen = gen
        self.untinted = untinted

    def _uniform(self, low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=self.gen))

    def one(self, size: int) -> torch.Tensor:
        index = int(torch.randint(len(self.pictures), (), generator=self.gen))
        picture = self.pictures[index]
        height, width = picture.shape[-2:]
        side = max(16, int(min(height, width) * self._uniform(0.3, 1.0)))
        top = int(torch.randint(height - side + 1, (), generator=self.gen))
        left = int(torch.randint(width - side + 1, (), generator=self.gen))
        crop = picture[None, :, top : top + side, left : left + side]
        crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        if torch.rand((), generator=self.gen) < 0.5:
            crop = crop.flip(-1)
        if self.grey[index]:
            if not (self.untinted and torch.rand((), generator=self.gen) < self.untinted):
                tint = torch.rand(3, generator=self.gen).to(crop.device) * 0.7 + 0.3
                crop = crop * (tint / tint.max())[None, :, None, None]
        elif torch.rand((), generator=self.gen) < 0.5:
            crop = crop[:, torch.randperm(3, generator=self.gen).to(crop.device)]
        return crop.clamp(0, 1)

    def batch(self, n: int, size: int) -> torch.Tensor:
        """-> [n, 3, size, size] in [0, 1]"""
        return torch.cat([self.one(size) for _ in range(n)])

    def palette(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``n`` pixels drawn from the training pictures with ``gen``, uniformly over pictures. -> [n, 3]"""
        which = torch.randint(len(self.pictures), (n,), generator=gen)
        colours = []
        for index, picture in enumerate(self.pictures):
            flat = picture.reshape(3, -1)
            count = int((which == index).sum())
            colours.append(flat[:, torch.randint(flat.shape[1], (count,), generator=gen).to(flat.device)].T)
        return torch.cat(colours)


class DeadLeaves:
    """Synthetic pictures of overlapping discs ("dead leaves"): radii with density r^-3, colours of training pixels,
    edges anti-aliased; the VAE sees more kinds of edge and colour than the training pictures hold.

    The palette comes from a generator of its own (``seed``), so it is the same after a resumption; the discs
    are drawn from the crops' generator, the data position a checkpoint keeps.
    """

    def __init__(self, crops: Crops, seed: int):
        self.gen = crops.gen
        self.colours = crops.palette(PALETTE, torch.Generator().manual_seed(seed))

    def _radii(self, shape, size: int) -> torch.Tensor:
        # inverse CDF of the density r^-3 on [low, high]
        low, high = (size * r for r in LEAF_RADII)
        u = torch.rand(shape, generator=self.gen)
        return (low**-2 - u * (low**-2 - high**-2)) ** -0.5

    def batch(self, n: int, size: int) -> torch.Tensor:
        """-> [n, 3, size, size] in [0, 1]; the disc drawn last lies on top."""
        device = self.colours.device
        radii = self._radii((n, LEAVES), size).to(device)
        centres = (torch.rand((n, LEAVES, 2), generator=self.gen) * size).to(device)
        picks = torch.randint(PALETTE, (n, LEAVES + 1), generator=self.gen).to(device)
        colours = self.colours[picks]  # [n, K + 1, 3]: the last is the background
        grid = torch.arange(size, device=device, dtype=torch.float32) + 0.5
        dy = grid[None, None, :, None] - centres[..., 0, None, None]
        dx = grid[None, None, None, :] - centres[..., 1, None, None]
        # coverage of each pixel by each disc, a one-pixel ramp at the edge: [n, K, size, size]
        alpha = (radii[..., None, None] - (dy**2 + dx**2).sqrt() + 0.5).clamp(0, 1)
        # what shows through every disc drawn after disc k
        above = torch.cumprod((1 - alpha).flip(1), dim=1).flip(1)
        through = torch.cat([above[:, 1:], torch.ones_like(above[:, :1])], dim=1)
        weights = alpha * through
        picture = torch.einsum("nkhw,nkc->nchw", weights, colours[:, :LEAVES])
        return (picture + above[:, :1] * colours[:, LEAVES, :, None, None]).clamp(0, 1)


def draw_edits(n: int, gen: torch.Generator, weights: dict | None = None) -> torch.Tensor:
    """``n`` indices into ``transforms.EDITS.names()``, each edit drawn in proportion to its weight (1 where not
    named); no weights: uniformly, by randint. -> [n] int64"""
    names = transforms.EDITS.names()
    if not weights:
        return torch.randint(len(names), (n,), generator=gen)
    return torch.multinomial(
        torch.tensor([weights.get(name, 1.0) for name in names]), n, replacement=True, generator=gen
    )


def vae_batch(
    crops: Crops,
    leaves: DeadLeaves,
    n: int,
    size: int,
    fraction: float,
    edited: float = 0.0,
    weights: dict | None = None,
) -> torch.Tensor:
    """``n`` training pictures for the VAE, ``fraction`` of them dead leaves, then ``edited`` of them (picked at
    random) each replaced by a known edit of itself, drawn as ``draw_edits`` does. -> [n, 3, size, size] in [0, 1]"""
    synthetic = round(n * fraction)
    parts = [crops.batch(n - synthetic, size)] if synthetic < n else []
    if synthetic:
        parts.append(leaves.batch(synthetic, size))
    batch = torch.cat(parts)
    count = round(n * edited)
    if count:
        names = transforms.EDITS.names()
        which = torch.randperm(n, generator=crops.gen)[:count].tolist()
        kinds = draw_edits(count, crops.gen, weights).tolist()
        for index, kind in zip(which, kinds):
            batch[index : index + 1] = transforms.apply(names[kind], batch[index : index + 1])
    return batch


class Pool:
    """Training edits, encoded once: ``size`` reference crops and every edit's correct output of each, as packed
    latents (bf16), so that a training step spends its time in the DiT, not in the VAE."""

    def __init__(self, refs: torch.Tensor, targets: torch.Tensor):
        self.names = transforms.EDITS.names()
        self.refs, self.targets = refs, targets  # [N, S, 64], [edits, N, S, 64]

    @classmethod
    def encode(cls, crops: Crops, codec, size: int, pixels: int, chunk: int = 64) -> Pool:
        """``size`` crops of ``pixels`` drawn from ``crops`` and every edit of each, through ``codec``."""
        names = transforms.EDITS.names()
        refs, targets = [], [[] for _ in names]
        for start in range(0, size, chunk):
            ref = crops.batch(min(chunk, size - start), pixels)
            refs.append(pack(codec.encode(ref)).bfloat16())
            for kind, name in enumerate(names):
                targets[kind].append(pack(codec.encode(transforms.apply(name, ref))).bfloat16())
        return cls(torch.cat(refs), torch.stack([torch.cat(t) for t in targets]))


class Batches:
    """Training edits drawn from a ``Pool``: a reference, an instruction (one phrasing of one edit, sometimes the
    empty prompt) and the correct output."""

    def __init__(
        self, pool: Pool, prompt_index: dict, prompt_dropout: float, gen: torch.Generator, weights: dict | None = None
    ):
        self.pool, self.gen, self.prompt_dropout = pool, gen, prompt_dropout
        self.prompt_index = prompt_index  # text -> row of the embedding table
        self.weights = weights

    def draw(self, n: int):
        """-> references [n, S, 64], correct outputs [n, S, 64] (fp32, on the pool's device), prompt rows [n]"""
        pool = self.pool
        picks = torch.randint(pool.refs.shape[0], (n,), generator=self.gen)
        kinds = draw_edits(n, self.gen, self.weights)
        rows = []
        for kind in kinds.tolist():
            phrasings = transforms.EDITS.get(pool.names[kind], "edit").phrasings
            text = phrasings[int(torch.randint(len(phrasings), (), generator=self.gen))]
            dropped = float(torch.rand((), generator=self.gen)) < self.prompt_dropout
            rows.append(self.prompt_index[EMPTY_PROMPT if dropped else text])
        device = pool.refs.device
        picks, kinds = picks.to(device), kinds.to(device)
        return pool.refs[picks].float(), pool.targets[kinds, picks].float(), torch.tensor(rows)
