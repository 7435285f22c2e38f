"""The bundled k2 sample: three of the dev lattices (`lattices/kal-dev000[0-2].lat.fst`) as one k2 FsaVec, as
icefall saves lattices (`torch.save(lats.as_dict())`), written by our k2 writer. Word ids are those of
`lattices/words.txt` on the labels (an acceptor, no aux_labels); `lm_scores` holds the decoder's graph part.

    python scripts/make_k2_sample.py            # writes lattices/k2/kal-dev.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from smallstate_lm.rescoring.formats.k2 import write_k2  # noqa: E402
from smallstate_lm.rescoring.formats.lattice_io import read_fst  # noqa: E402
from smallstate_lm.rescoring.lattices.lattice import SymbolTable  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "lattices" / "k2" / "kal-dev.pt")
    p.add_argument("inputs", nargs="*", type=Path,
                   default=[ROOT / "lattices" / f"kal-dev000{i}.lat.fst" for i in range(3)])
    args = p.parse_args()
    symbols = SymbolTable.read(ROOT / "lattices" / "words.txt")
    # prepared: start 0, states in topological order, as k2's lattices are
    lattices = [read_fst(f, symbols).prepare() for f in args.inputs]
    write_k2(args.out, lattices, vec=True)
    print(f"{args.out}: {len(lattices)} FSAs, {sum(x.num_arcs for x in lattices)} arcs")


if __name__ == "__main__":
    main()
