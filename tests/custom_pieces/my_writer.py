"""A metrics writer of a user's own (`log.writers: [my_writer:JsonlCopy]`): every record, as JSON lines."""
import json
import os


class JsonlCopy:
    def __init__(self, directory, config):
        os.makedirs(directory, exist_ok=True)
        self.file = open(os.path.join(directory, "records.jsonl"), "w")

    def write(self, record):
        self.file.write(json.dumps(record) + "\n")

    def close(self):
        self.file.close()
