"""Closed forms the library is checked against: compressor constants (:mod:`.compressors`), step sizes
and rates (:mod:`.rates`), transport cost models (:mod:`.costs`) and test problems (:mod:`.problems`)."""
