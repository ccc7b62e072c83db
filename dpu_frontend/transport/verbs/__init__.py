"""The verbs transport: pyverbs on mlx5 (BlueField) or rxe (soft-RoCE)."""
