"""The VLA model: composition of vision / projector / llm / action_head, flavors and loading."""
