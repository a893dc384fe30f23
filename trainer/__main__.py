import time

started = time.perf_counter()  # before torch and ucp are imported: the resume's time to first step counts them

from .train import main

main(started=started)
