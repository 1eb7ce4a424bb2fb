"""CPU kernels that replace MLX's where they are faster here: blockwise attention, SwiGLU, chunked Gated DeltaNet, compiled C."""
