package serve

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/protobuf/encoding/protojson"
)

// workersFile is where the registrations are kept beside the snapshot:
// the snapshot holds each worker's index state, not how to reach it.
func (s *Server) workersFile() string { return s.cfg.Snapshot + ".workers" }

// load restores the saved index (before the pipeline runs, as Restore
// requires) and adds the operator's workers, then the registered ones.
func (s *Server) load(ctx context.Context) error {
	var saved []*kvpipev1.WorkerSpec
	if s.cfg.Snapshot != "" {
		snap, err := kvpipe.LoadSnapshot(ctx, kvpipe.FileStore{Path: s.cfg.Snapshot})
		switch {
		case errors.Is(err, kvpipe.ErrNoSnapshot):
		case err != nil:
			return fmt.Errorf("serve: snapshot %s: %w", s.cfg.Snapshot, err)
		default:
			if err := s.cfg.Pipeline.Restore(snap); err != nil {
				return fmt.Errorf("serve: snapshot %s: %w", s.cfg.Snapshot, err)
			}
			s.cfg.Logger.Info("serve: snapshot restored", "workers", snap.Workers(), "blocks", snap.Blocks())
		}
		if saved, err = s.readWorkers(); err != nil {
			return err
		}
	}
	for _, w := range s.cfg.Workers {
		if _, err := s.svc.register(ctx, w, true); err != nil {
			return fmt.Errorf("serve: worker %q: %w", w.GetName(), err)
		}
	}
	for _, w := range saved {
		if s.svc.spec(w.GetName()) != nil {
			continue // the operator's own, which wins
		}
		// Checked again: the allow-list may have changed since.
		if _, err := s.svc.register(ctx, w, false); err != nil {
			s.cfg.Logger.Warn("serve: a saved registration is refused", "worker", w.GetName(), "err", err)
		}
	}
	return nil
}

func (s *Server) readWorkers() ([]*kvpipev1.WorkerSpec, error) {
	data, err := os.ReadFile(s.workersFile())
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	var list kvpipev1.ListWorkersResponse
	if err := protojson.Unmarshal(data, &list); err != nil {
		return nil, fmt.Errorf("serve: %s: %w", s.workersFile(), err)
	}
	out := make([]*kvpipev1.WorkerSpec, 0, len(list.Workers))
	for _, w := range list.Workers {
		out = append(out, w.Spec)
	}
	return out, nil
}

// saveWorkers writes the registrations, atomically; a failure is logged,
// since the registration itself stands.
func (s *Server) saveWorkers() {
	if s.cfg.Snapshot == "" {
		return
	}
	s.save.Lock()
	defer s.save.Unlock()
	var list kvpipev1.ListWorkersResponse
	for _, r := range s.svc.registrations() {
		list.Workers = append(list.Workers, &kvpipev1.WorkerStatus{Name: r.spec.Name, Spec: r.spec})
	}
	data, err := protojson.MarshalOptions{Multiline: true}.Marshal(&list)
	if err == nil {
		err = writeAtomic(s.workersFile(), data)
	}
	if err != nil {
		s.cfg.Logger.Warn("serve: registrations not saved", "err", err)
	}
}

func writeAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// saveState saves the index and the registrations, while the pipeline
// still runs (Snapshot needs it).
func (s *Server) saveState() error {
	if s.cfg.Snapshot == "" {
		return nil
	}
	s.saveWorkers()
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.DrainTimeout+20*time.Second)
	defer cancel()
	if err := s.cfg.Pipeline.SaveSnapshot(ctx, kvpipe.FileStore{Path: s.cfg.Snapshot}); err != nil {
		return fmt.Errorf("serve: snapshot not saved: %w", err)
	}
	s.cfg.Logger.Info("serve: snapshot saved", "path", s.cfg.Snapshot)
	return nil
}

// saveEvery saves the state every SnapshotEvery until ctx ends, so that a
// crash loses at most that much (a failure is logged and tried again).
func (s *Server) saveEvery(ctx context.Context) {
	if s.cfg.Snapshot == "" || s.cfg.SnapshotEvery <= 0 {
		return
	}
	t := time.NewTicker(s.cfg.SnapshotEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		sctx, cancel := context.WithTimeout(ctx, s.cfg.SnapshotEvery+30*time.Second)
		err := s.cfg.Pipeline.SaveSnapshot(sctx, kvpipe.FileStore{Path: s.cfg.Snapshot})
		cancel()
		if err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("serve: periodic snapshot not saved", "err", err)
		}
	}
}
