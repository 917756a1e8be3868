package bench

import (
	"os"
	"testing"
)

// TestMain runs this binary as BenchmarkServeRemote's client process when
// it was started as one; otherwise it runs the benchmarks.
func TestMain(m *testing.M) {
	if spec, ok := os.LookupEnv(clientEnv); ok {
		os.Exit(runClientProcess(spec, os.Stdin, os.Stdout))
	}
	os.Exit(m.Run())
}
