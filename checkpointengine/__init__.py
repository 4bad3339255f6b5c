"""The weight plane: versioned, bucketed weight transfer from trainers to rollers."""
