"""The little that rollers and trainers both need: model loading, the sample schema, process set-up."""
