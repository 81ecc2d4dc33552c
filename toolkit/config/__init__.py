"""DeepSpeed JSON configs: the schema, reading, validation, rules across fields, generation."""
