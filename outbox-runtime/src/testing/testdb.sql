-- The testing kit's template snapshot and reset (testing/db.rs): run in a
-- template database after its migrations.
CREATE SCHEMA _outbox_testdb;

CREATE FUNCTION _outbox_testdb.fingerprint() RETURNS text LANGUAGE sql STABLE AS $f$
  WITH user_ns AS (
    SELECT oid, nspname FROM pg_namespace
    WHERE nspname NOT IN ('pg_catalog', 'information_schema', '_outbox_testdb')
      AND nspname NOT LIKE 'pg\_toast%' AND nspname NOT LIKE 'pg\_temp%'
  ), rels AS (
    SELECT c.oid, n.nspname, c.relname, c.relkind FROM pg_class c JOIN user_ns n ON n.oid = c.relnamespace
  ), items AS (
    SELECT 'n:' || nspname AS item FROM user_ns
    UNION ALL SELECT format('r:%s.%s:%s', nspname, relname, relkind) FROM rels
    UNION ALL SELECT format('a:%s.%s.%s:%s:%s:%s', r.nspname, r.relname, a.attname,
                            format_type(a.atttypid, a.atttypmod), a.attnotnull,
                            pg_get_expr(d.adbin, d.adrelid))
      FROM rels r JOIN pg_attribute a ON a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
      LEFT JOIN pg_attrdef d ON d.adrelid = r.oid AND d.adnum = a.attnum
    UNION ALL SELECT format('c:%s.%s:%s', r.nspname, co.conname, pg_get_constraintdef(co.oid))
      FROM pg_constraint co JOIN rels r ON r.oid = co.conrelid
    UNION ALL SELECT 'i:' || pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN rels r ON r.oid = i.indrelid
    UNION ALL SELECT 't:' || pg_get_triggerdef(t.oid) FROM pg_trigger t JOIN rels r ON r.oid = t.tgrelid
      WHERE NOT t.tgisinternal
    UNION ALL SELECT format('v:%s.%s:%s', r.nspname, r.relname, pg_get_viewdef(r.oid))
      FROM rels r WHERE r.relkind IN ('v', 'm')
    UNION ALL SELECT format('f:%s:%s', p.oid::regprocedure, md5(p.prosrc))
      FROM pg_proc p JOIN user_ns n ON n.oid = p.pronamespace
    UNION ALL SELECT format('y:%s.%s:%s', n.nspname, t.typname, t.typtype)
      FROM pg_type t JOIN user_ns n ON n.oid = t.typnamespace WHERE t.typtype IN ('e', 'd', 'c')
    UNION ALL SELECT format('e:%s:%s', e.enumtypid::regtype, e.enumlabel) FROM pg_enum e
    UNION ALL SELECT format('x:%s:%s', extname, extversion) FROM pg_extension
  )
  SELECT md5(string_agg(item, E'\n' ORDER BY item)) FROM items
$f$;

-- The user tables (the migrations' bookkeeping aside).
CREATE FUNCTION _outbox_testdb.tables() RETURNS SETOF regclass LANGUAGE sql STABLE AS $f$
  SELECT c.oid::regclass FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
    AND n.nspname NOT IN ('pg_catalog', 'information_schema', '_outbox_testdb')
    AND n.nspname NOT LIKE 'pg\_toast%' AND n.nspname NOT LIKE 'pg\_temp%'
    AND c.oid IS DISTINCT FROM to_regclass('public._sqlx_migrations')
$f$;

CREATE TABLE _outbox_testdb.sequences (seq regclass PRIMARY KEY, last_value bigint NOT NULL, is_called bool NOT NULL);
CREATE TABLE _outbox_testdb.seeds (tbl regclass PRIMARY KEY, copy text NOT NULL, columns text NOT NULL);
CREATE TABLE _outbox_testdb.fingerprint (value text NOT NULL);

-- Resets a clone to the template's state; false when its schema differs
-- from the template's (then it is not reused). Rows go with DELETE: on
-- the small tables of a test it costs a fraction of TRUNCATE, which
-- creates new files for each table and index; tables over 8 MB, and
-- tables a pass of DELETEs cannot empty (foreign keys in a cycle, delete
-- triggers writing to emptied tables), are truncated.
CREATE FUNCTION _outbox_testdb.reset() RETURNS boolean LANGUAGE plpgsql AS $f$
DECLARE
  t regclass;
  filled regclass[] := '{}';
  pending regclass[];
  big regclass[] := '{}';
  nonempty boolean;
  s record;
BEGIN
  IF _outbox_testdb.fingerprint() IS DISTINCT FROM (SELECT value FROM _outbox_testdb.fingerprint) THEN
    RETURN false;
  END IF;
  FOR t IN SELECT * FROM _outbox_testdb.tables() LOOP
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', t) INTO nonempty;
    IF nonempty AND pg_relation_size(t) > 8 * 1024 * 1024 THEN
      big := big || t;
    ELSIF nonempty THEN
      filled := filled || t;
    END IF;
  END LOOP;
  -- A table other rows still reference waits for the next pass.
  WHILE cardinality(filled) > 0 LOOP
    pending := '{}';
    FOREACH t IN ARRAY filled LOOP
      BEGIN
        EXECUTE format('DELETE FROM %s', t);
      EXCEPTION WHEN foreign_key_violation THEN
        pending := pending || t;
      END;
    END LOOP;
    IF cardinality(pending) = cardinality(filled) THEN
      big := big || pending;
      EXIT;
    END IF;
    filled := pending;
  END LOOP;
  FOR t IN SELECT * FROM _outbox_testdb.tables() LOOP
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', t) INTO nonempty;
    IF nonempty AND NOT t = ANY (big) THEN
      big := big || t;
    END IF;
  END LOOP;
  IF cardinality(big) > 0 THEN
    EXECUTE 'TRUNCATE ' || array_to_string(big::text[], ', ') || ' CASCADE';
  END IF;
  FOR s IN SELECT * FROM _outbox_testdb.seeds LOOP
    EXECUTE format('INSERT INTO %s (%s) OVERRIDING SYSTEM VALUE SELECT %s FROM _outbox_testdb.%I',
                   s.tbl, s.columns, s.columns, s.copy);
  END LOOP;
  FOR s IN SELECT * FROM _outbox_testdb.sequences LOOP
    PERFORM setval(s.seq, s.last_value, s.is_called);
  END LOOP;
  RETURN true;
END
$f$;

-- The snapshot of the migrated state.
DO $d$
DECLARE
  t regclass;
  s regclass;
  n int := 0;
  nonempty boolean;
  cols text;
  v record;
BEGIN
  FOR t IN SELECT * FROM _outbox_testdb.tables() LOOP
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', t) INTO nonempty;
    IF nonempty THEN
      n := n + 1;
      SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO cols
        FROM pg_attribute WHERE attrelid = t AND attnum > 0 AND NOT attisdropped AND attgenerated = '';
      EXECUTE format('CREATE TABLE _outbox_testdb.%I AS SELECT %s FROM %s', 'seed_' || n, cols, t);
      INSERT INTO _outbox_testdb.seeds VALUES (t, 'seed_' || n, cols);
    END IF;
  END LOOP;
  FOR s IN SELECT c.oid::regclass FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
           WHERE c.relkind = 'S' AND ns.nspname NOT IN ('pg_catalog', 'information_schema', '_outbox_testdb')
             AND ns.nspname NOT LIKE 'pg\_temp%' LOOP
    EXECUTE format('SELECT last_value, is_called FROM %s', s) INTO v;
    INSERT INTO _outbox_testdb.sequences VALUES (s, v.last_value, v.is_called);
  END LOOP;
  INSERT INTO _outbox_testdb.fingerprint SELECT _outbox_testdb.fingerprint();
END
$d$;
