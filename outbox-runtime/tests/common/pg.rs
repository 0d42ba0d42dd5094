//! A PostgreSQL server of the test's own (`initdb` into a temporary
//! directory, `pg_ctl` to start and stop it), so that it can be restarted
//! under load without touching the shared server. As root the server runs
//! as the `postgres` user (`runuser`): PostgreSQL refuses to run as root.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use uuid::Uuid;

/// A private PostgreSQL server; stopped and removed on drop.
pub struct PrivatePostgres {
    bin: PathBuf,
    dir: PathBuf,
    pub port: u16,
    as_postgres: bool,
}

impl PrivatePostgres {
    /// Creates and starts a server, or says why it cannot and returns `None`.
    pub fn start() -> Option<Self> {
        let server = Self::create()?;
        server.start_again();
        Some(server)
    }

    /// Creates and starts a server with TLS on (the certificate of `pki`
    /// for `localhost`, its CA for client certificates) and `hba` as its
    /// `pg_hba.conf`.
    pub fn start_tls(pki: &super::tls::Pki, hba: &str) -> Option<Self> {
        let server = Self::create()?;
        let data = std::path::PathBuf::from(server.data());
        for (name, from) in [
            ("server.pem", "server.pem"),
            ("server.key", "server.key"),
            ("ca.pem", "ca.pem"),
        ] {
            let to = data.join(name);
            std::fs::copy(pki.dir.join(from), &to).expect("copy certificate");
            super::tls::set_mode(&to, 0o600);
            if server.as_postgres {
                let ok = Command::new("chown")
                    .args(["postgres:", to.to_str().expect("utf-8 path")])
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(ok, "chown {}", to.display());
            }
        }
        let conf = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str(
            "\nssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\nssl_ca_file = 'ca.pem'\n",
        );
        std::fs::write(&conf, text).expect("postgresql.conf");
        std::fs::write(data.join("pg_hba.conf"), hba).expect("pg_hba.conf");
        server.start_again();
        Some(server)
    }

    fn create() -> Option<Self> {
        let Some(bin) = bindir() else {
            eprintln!(
                "SKIPPED: no PostgreSQL server binaries (initdb, pg_ctl) found via pg_config or /usr/lib/postgresql/*/bin"
            );
            return None;
        };
        let as_postgres = is_root();
        if as_postgres && !Path::new("/usr/sbin/runuser").exists() && which("runuser").is_none() {
            eprintln!(
                "SKIPPED: running as root and `runuser` is missing to run PostgreSQL as `postgres`"
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!("outbox-pg-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("data directory");
        if as_postgres {
            let ok = Command::new("chown")
                .args(["postgres:", dir.to_str().expect("utf-8 path")])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!(
                    "SKIPPED: cannot hand {} to the postgres user",
                    dir.display()
                );
                return None;
            }
        }
        let server = Self {
            bin,
            dir,
            port: crate::common::free_port(),
            as_postgres,
        };
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "--auth=trust",
                "-N",
                "-E",
                "UTF8",
            ],
        );
        Some(server)
    }

    fn data(&self) -> String {
        self.dir.join("data").to_string_lossy().into_owned()
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the (stopped) server and waits until it accepts connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log").to_string_lossy().into_owned();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                &log,
                "-o",
                &options,
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
    }

    /// Stops the server the hard way (`-m immediate`: no checkpoint, crash
    /// recovery at the next start; committed transactions survive).
    pub fn crash(&self) {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
    }

    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    fn run(&self, program: &str, args: &[&str]) {
        let out = self
            .command(program)
            .args(args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .args(["-D", &self.data(), "-m", "immediate", "stop"])
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The server binaries: `pg_config --bindir`, else the newest
/// `/usr/lib/postgresql/*/bin`; `None` if neither holds `initdb`.
fn bindir() -> Option<PathBuf> {
    let from_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let mut candidates: Vec<PathBuf> = from_config.into_iter().collect();
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("bin")).collect();
        versions.sort();
        candidates.extend(versions.into_iter().rev());
    }
    candidates
        .into_iter()
        .find(|dir| dir.join("initdb").exists() && dir.join("pg_ctl").exists())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(program))
            .find(|p| p.exists())
    })
}
