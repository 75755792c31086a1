#!/usr/bin/python3
"""Write nanoGPT-style train.bin / val.bin (uint16 LE) + meta.pkl (vocab 256)
from exactly the bytes himoe-trainer uses for --data /usr/share/games/fortunes
--val_fraction 0.1 (mirrors trainer/data.cc SelectTextFiles and
ReadByteSplits):
  * walk the path recursively (regular files, symlinks to files followed,
    directory symlinks not followed), sort by full path string, dedupe;
  * skip *.dat; skip X.u8 when a regular file X exists beside it; skip a file
    whose canonical path was already taken; skip files with a NUL byte in the
    first 4096 bytes;
  * per file, val = min(size, llround(size * val_fraction)) LAST bytes, train =
    the rest; train parts concatenated in order, likewise val parts.
"""
import argparse, math, os, pickle, sys
import numpy as np

def collect(path, out):
    if os.path.isfile(path):
        out.append(path); return
    if not os.path.isdir(path):
        sys.exit(f"not a file or directory: {path}")
    for root, dirs, files in os.walk(path, followlinks=False):
        # os.walk lists symlinks-to-dirs in dirs but does not descend (followlinks=False)
        for name in dirs + files:
            p = os.path.join(root, name)
            if os.path.isfile(p):  # follows symlinks, like directory_entry::is_regular_file
                out.append(p)

def select(paths, val_fraction):
    cand = []
    for p in paths: collect(p, cand)
    cand = sorted(set(cand), key=lambda s: s.encode())
    taken, canon, skipped = [], set(), []
    for p in cand:
        name = os.path.basename(p)
        if name.endswith('.dat'):
            skipped.append((p, '.dat index')); continue
        if name.endswith('.u8') and len(name) > 3 and os.path.isfile(os.path.join(os.path.dirname(p), name[:-3])):
            skipped.append((p, '.u8 copy of a sibling')); continue
        c = os.path.realpath(p)
        if c in canon:
            skipped.append((p, 'duplicate')); continue
        canon.add(c)
        size = os.path.getsize(p)
        with open(p, 'rb') as f: head = f.read(min(size, 4096))
        if b'\0' in head:
            skipped.append((p, 'binary')); continue
        val = min(size, int(math.floor(size * val_fraction + 0.5)))  # llround, x >= 0
        taken.append((p, size, val))
    return taken, skipped

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--data', default='/usr/share/games/fortunes')
    ap.add_argument('--val_fraction', type=float, default=0.1)
    ap.add_argument('--out', required=True)
    a = ap.parse_args()
    taken, skipped = select([a.data], a.val_fraction)
    train, val = bytearray(), bytearray()
    for p, size, v in taken:
        with open(p, 'rb') as f: b = f.read()
        assert len(b) == size
        train += b[:size - v]; val += b[size - v:]
    os.makedirs(a.out, exist_ok=True)
    np.frombuffer(bytes(train), dtype=np.uint8).astype('<u2').tofile(os.path.join(a.out, 'train.bin'))
    np.frombuffer(bytes(val), dtype=np.uint8).astype('<u2').tofile(os.path.join(a.out, 'val.bin'))
    with open(os.path.join(a.out, 'meta.pkl'), 'wb') as f:
        pickle.dump({'vocab_size': 256}, f)
    with open(os.path.join(a.out, 'files.txt'), 'w') as f:
        for p, size, v in taken: f.write(f"{p}\t{size}\t{v}\n")
    print(f"bytes corpus {a.data}: {len(taken)} files ({len(skipped)} skipped), "
          f"{len(train) + len(val)} bytes; train {len(train)}, val {len(val)}; vocab 256 -> {a.out}")

if __name__ == '__main__':
    main()
