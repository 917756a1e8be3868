package engineenc

import (
	"testing"

	"github.com/kvpipe/kvpipe/internal/ztest"
)

func TestMain(m *testing.M) { ztest.VerifyNoLeaks(m) }
