"""Where the engine steps: a thread of the replica or its own process, and the messages between."""
