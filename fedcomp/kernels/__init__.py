"""GPU kernel path (Triton) with torch reference fallbacks; see docs/kernels.md. Never imports triton itself."""
