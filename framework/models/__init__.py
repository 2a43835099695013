"""Model loading (Hugging Face directories) and layers shared by model plugins."""
