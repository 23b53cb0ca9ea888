//! Helpers for cross-process tests: locate the built binaries, make temp dirs.
