"""Neural scoring of word sequences: prefix tries (trie), tree attention over them (tree_attention), the choice
between trees and padded rows (paths) and the scorer (scorer). Only scorer and tree_attention import torch."""
