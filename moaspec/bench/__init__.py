"""``moaspec bench``: decoding methods compared side by side on SpecBench-format questions."""
