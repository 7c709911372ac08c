R=/work/main/.venv/bin/rsd
run() { $R generate "Write a story about a cat." -n 64 -v ar -t 0 --json -q 2>/dev/null < /dev/null | python3 -c "import sys,json; r=json.loads(sys.stdin.read()); print(round(r['stats']['tokens_per_second'],1))"; }
for hogs in 0 1 2; do
  pids=""
  for i in $(seq 1 $hogs); do python3 -c "while True: pass" & pids="$pids $!"; done
  sleep 1
  a=$(run); b=$(OMP_NUM_THREADS=1 run)
  echo "hogs=$hogs threads=2: $a tok/s  threads=1: $b tok/s"
  for p in $pids; do kill $p; done
done
